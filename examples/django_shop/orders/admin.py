from django.contrib import admin

from .models import Charge, Order

admin.site.register(Order)
admin.site.register(Charge)
