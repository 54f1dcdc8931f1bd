"""The errands dashboard inside Django's ASGI application.

In ``asgi.py``::

    from django.core.asgi import get_asgi_application
    from errands.contrib.django.asgi import with_dashboard

    application = with_dashboard(get_asgi_application(), path="/admin/jobs")

Every request under ``path`` goes to the dashboard, the rest to Django. By default only
signed-in Django staff users see it (:func:`staff_user`, from Django's session cookie);
``authorize=`` narrows what they may do (``"read"``, ``"all"``, or a set of actions).
Needs the dashboard extra: ``pip install 'errands[dashboard]'``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async

from .app import get_app


def _staff_name(session_key: str | None) -> str | None:
    from django.conf import settings
    from django.contrib.auth import (
        BACKEND_SESSION_KEY,
        HASH_SESSION_KEY,
        SESSION_KEY,
        get_user_model,
    )
    from django.db import close_old_connections
    from django.utils.crypto import constant_time_compare
    from django.utils.module_loading import import_string

    if not session_key:
        return None
    close_old_connections()
    try:
        engine = import_string(settings.SESSION_ENGINE)
        session = engine.SessionStore(session_key)
        user_id = session.get(SESSION_KEY)
        if (
            user_id is None
            or session.get(BACKEND_SESSION_KEY) not in settings.AUTHENTICATION_BACKENDS
        ):
            return None
        model = get_user_model()
        user = model._default_manager.filter(pk=model._meta.pk.to_python(user_id)).first()
        if user is None or not user.is_active or not user.is_staff:
            return None
        verify = getattr(user, "get_session_auth_hash", None)
        stored = session.get(HASH_SESSION_KEY)
        if verify is not None and not (stored and constant_time_compare(stored, verify())):
            return None  # the password changed since this session signed in
        return str(user.get_username())
    finally:
        close_old_connections()


async def staff_user(request: Any) -> str | None:
    """The dashboard's ``user=`` resolver: the username of the Django staff user signed in
    with this browser (Django's session cookie), else None (no access)."""
    from django.conf import settings

    return await sync_to_async(_staff_name, thread_sensitive=True)(
        request.cookies.get(settings.SESSION_COOKIE_NAME)
    )


def dashboard(
    alias: str = "default",
    *,
    user: Callable[[Any], Any] | None = staff_user,
    **options: Any,
) -> Any:
    """The dashboard of task backend ``alias`` as an ASGI app (``create_app`` options)."""
    from ...dashboard import create_app

    return create_app(get_app(alias), user=user, **options)


def with_dashboard(
    django_application: Any,
    *,
    path: str = "/admin/jobs",
    alias: str = "default",
    **options: Any,
) -> Any:
    """Django's ASGI application with the dashboard mounted at ``path``."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    prefix = "/" + path.strip("/")
    return Starlette(
        routes=[
            Mount(prefix, app=dashboard(alias, **options)),
            Mount("", app=django_application),
        ]
    )
