"""Django's ASGI application, with errands' dashboard at /admin/jobs/ for staff users
(uvicorn shop.asgi:application)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
django_application = get_asgi_application()

from errands.contrib.django.asgi import with_dashboard  # noqa: E402 - needs Django set up

application = with_dashboard(django_application, path="/admin/jobs")
