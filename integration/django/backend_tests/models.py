from __future__ import annotations

from django.db import models


class Order(models.Model):
    number = models.CharField(max_length=32, unique=True)
    paid = models.BooleanField(default=False)

    class Meta:
        app_label = "backend_tests"
