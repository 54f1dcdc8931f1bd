"""A fake payment provider with the behaviour that matters: idempotency keys, permanent
declines and transient outages."""

from __future__ import annotations

import threading

from django.db import IntegrityError, transaction

from .models import Charge

DECLINED = "tok_declined"
FLAKY = "tok_flaky"  # the provider times out on the first call for this card

_outages: set[str] = set()
_lock = threading.Lock()


class CardDeclined(Exception):
    """The bank said no: retrying will not change its mind."""


class ProviderUnavailable(Exception):
    """A timeout or a 503: worth retrying."""


def charge(card_token: str, amount_cents: int, *, idempotency_key: str) -> str:
    """Charge the card once per idempotency key; returns the charge id."""
    if card_token == DECLINED:
        raise CardDeclined(f"card {card_token} declined")
    if card_token == FLAKY:
        with _lock:
            first_call = idempotency_key not in _outages
            _outages.add(idempotency_key)
        if first_call:
            raise ProviderUnavailable("payment provider timed out")
    try:
        with transaction.atomic():
            created = Charge.objects.create(
                idempotency_key=idempotency_key, card_token=card_token, amount_cents=amount_cents
            )
    except IntegrityError:  # the same request again: the provider returns the first charge
        created = Charge.objects.get(idempotency_key=idempotency_key)
    return f"ch_{created.pk}"
