from django.urls import path

from . import views

urlpatterns = [
    path("", views.checkout, name="checkout"),
    path("<int:order_id>/", views.order_status, name="order-status"),
]
