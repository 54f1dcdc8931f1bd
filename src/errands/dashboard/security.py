"""Who may open the dashboard, what they may do, and the checks on every state change.

Three ways to let a user in, chosen by :func:`errands.dashboard.create_app`'s options:

* ``user=callable(request)``: the host application's own login (FastAPI, Django, ...) or a
  reverse proxy's authentication (:func:`header_user`) names the user; ``None`` means not
  signed in. This is the **only** source of an authenticated identity.
* ``password=`` / ``token=`` (or ``ERRANDS_DASHBOARD_PASSWORD`` / ``ERRANDS_DASHBOARD_TOKEN``):
  the dashboard's own login page, one secret shared by everyone. The name typed there is a
  label for the header and the audit log, never an identity.
* neither: no login, and then only direct loopback clients naming a loopback ``Host`` are
  served (so neither a DNS-rebinding page nor a same-host proxy can reach it).

Each request's :class:`Identity` tells these apart. What the user may do comes from
``authorize(request)``, Oban Web's model: ``"all"``, ``"read"`` (read-only), a set of action
names from :data:`ACTIONS`, or ``None`` to refuse the dashboard altogether. Every POST
carries the session's CSRF token.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from ..errors import ConfigurationError
from .throttle import LoginThrottle

ACTIONS = frozenset({"cancel", "replay", "discard", "pause", "signal", "edit"})
"""Action names ``authorize`` may grant: ``pause`` covers pausing and resuming queues."""

PASSWORD_ENV = "ERRANDS_DASHBOARD_PASSWORD"
TOKEN_ENV = "ERRANDS_DASHBOARD_TOKEN"
SECRET_ENV = "ERRANDS_DASHBOARD_SECRET"

LOCAL_USER = "local"
UNNAMED = "unnamed"  # the label of a shared-secret login that typed no name
LOGIN_PHRASES = {
    "password": "shared password",
    "token": "shared token",
    "loopback": "loopback, no login",
}
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
RESOLVER_TIMEOUT = 5.0  # seconds user= and authorize= may take before the request is denied
RESOLVER_THREADS = 16  # plain-function resolvers running at once (hung ones included)

UserResolver = Callable[[Any], "str | Awaitable[str | None] | None"]
Authorize = Callable[[Any], Any]

log = logging.getLogger("errands.dashboard")
_resolver_slots = threading.BoundedSemaphore(RESOLVER_THREADS)
_NO_SLOT = object()  # a resolver thread found no free slot before its deadline


@dataclass(frozen=True)
class Access:
    """The actions one user may take; ``read`` (no actions) when empty."""

    actions: frozenset[str] = frozenset()

    @property
    def read_only(self) -> bool:
        return not self.actions

    def can(self, action: str) -> bool:
        return action in self.actions


@dataclass(frozen=True)
class Identity:
    """Who is asking, as far as the dashboard can tell (``request.state.identity``).

    ``user`` is an authenticated identity, set only by the ``user=`` resolver (your own login,
    or a proxy header you trust); it is also ``request.state.user``. Otherwise it is None:
    with a shared password or token, ``label`` is whatever name was typed on the login form
    and grants nothing. ``method`` is how the request got in: ``"user"``, ``"password"``,
    ``"token"`` or ``"loopback"`` (no login).
    """

    label: str
    method: str
    user: str | None = None

    @property
    def verified(self) -> bool:
        """True when ``user`` came from the ``user=`` resolver, not from a typed name."""
        return self.user is not None

    @property
    def actor(self) -> str:
        """Who the audit log says did it: ``dashboard:<label>``, plus how they signed in
        unless the name was authenticated, e.g. ``dashboard:alice (shared password)``."""
        if self.verified:
            return f"dashboard:{self.label}"
        return f"dashboard:{self.label} ({LOGIN_PHRASES[self.method]})"


ALL = Access(ACTIONS)
READ = Access(frozenset())


def parse_access(value: Any) -> Access | None:
    """Turn what ``authorize`` returned into an :class:`Access`; None means no access.

    Raises ConfigurationError for anything else, without iterating or printing arbitrary
    objects (a hostile ``authorize`` could return an endless generator).
    """
    if isinstance(value, Access):
        return value
    if value is None or value is False:
        return None
    if value is True:
        return ALL
    if isinstance(value, str):
        return _access_word(str.__str__(value))  # a str subclass's methods never run
    if isinstance(value, (set, frozenset, list, tuple)):
        return _access_names(value)
    raise ConfigurationError(
        f"authorize(request) returned a {type(value).__name__}; return 'all', 'read', None "
        "or a set of action names"
    )


def _access_word(value: str) -> Access | None:
    word = value.strip().lower().replace("-", "_")
    if word == "all":
        return ALL
    if word in ("read", "read_only", "readonly"):
        return READ
    if word in ("none", "forbidden", "deny"):
        return None
    if word in ACTIONS:
        return Access(frozenset({word}))
    raise ConfigurationError(
        f"authorize(request) returned {value[:40]!r}; return 'all', 'read', None (no access) "
        f"or a set of actions from {sorted(ACTIONS)}"
    )


def _access_names(value: set[Any] | frozenset[Any] | list[Any] | tuple[Any, ...]) -> Access:
    wrong = next((v for v in value if not isinstance(v, str)), None)
    if wrong is not None:
        raise ConfigurationError(
            f"authorize(request) returned a {type(value).__name__} holding a "
            f"{type(wrong).__name__}; the actions are names from {sorted(ACTIONS)}"
        )
    names = {str.__str__(v).strip().lower() for v in value}
    unknown = names - ACTIONS
    if unknown:
        raise ConfigurationError(
            f"authorize(request) granted unknown action(s) {sorted(unknown)[:10]}; "
            f"the actions are {sorted(ACTIONS)}"
        )
    return Access(frozenset(names))


class ResolverError(Exception):
    """The operator's ``user=`` or ``authorize=`` failed: raised, hung or answered nonsense.

    Already logged; the message is safe to show (it never quotes the exception's text).
    """


async def call_resolver(name: str, fn: Callable[[Any], Any], request: Any, timeout: float) -> Any:
    """``fn(request)``, treated as hostile: what it returns, else ResolverError.

    A plain function runs in a worker thread (it must not block the event loop); at most
    :data:`RESOLVER_THREADS` run at once, so hung ones cannot pile up threads. An ``async``
    one runs on the loop (and must not block it). Either is abandoned after ``timeout``.
    """
    with anyio.move_on_after(timeout):
        try:
            result = await _call(fn, request, time.monotonic() + timeout)
        except Exception as exc:
            log.error(
                "%s(request) raised %s; the request is denied",
                name,
                type(exc).__name__,
                exc_info=True,
            )
            raise ResolverError(
                f"The dashboard's {name}(request) failed ({type(exc).__name__}); the error "
                "is in the server log."
            ) from None
        if result is not _NO_SLOT:
            return result
    log.error("%s(request) did not answer within %g s; the request is denied", name, timeout)
    raise ResolverError(
        f"The dashboard's {name}(request) did not answer within {timeout:g} s; see the server log."
    )


async def _call(fn: Callable[[Any], Any], request: Any, deadline: float) -> Any:
    if _is_async(fn):
        result = fn(request)
    else:
        result = await anyio.to_thread.run_sync(
            _call_in_slot, fn, request, deadline, abandon_on_cancel=True
        )
    if inspect.isawaitable(result):
        result = await result
    return result


def _is_async(fn: Callable[..., Any]) -> bool:
    """True for an ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _call_in_slot(fn: Callable[[Any], Any], request: Any, deadline: float) -> Any:
    """In a worker thread: ``fn(request)`` once a slot frees up before ``deadline``."""
    if not _resolver_slots.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
        return _NO_SLOT
    try:
        return fn(request)
    finally:
        _resolver_slots.release()


async def resolve_access(auth: AuthConfig, request: Any) -> Access | None:
    """What ``auth.authorize`` grants this request (everything without one)."""
    if auth.authorize is None:
        return ALL
    value = await call_resolver("authorize", auth.authorize, request, auth.timeout)
    try:
        return parse_access(value)
    except ConfigurationError as exc:
        log.error("%s; the request is denied", exc)
        raise ResolverError(str(exc)) from None
    except Exception as exc:  # reading it ran its code (a set subclass's __iter__, say)
        raise _unreadable("authorize", value, exc) from None


async def resolve_user(auth: AuthConfig, request: Any) -> str | None:
    """The name ``auth.user`` gives this request, None for nobody signed in."""
    assert auth.user is not None
    value = await call_resolver("user", auth.user, request, auth.timeout)
    if value is None or value is False:
        return None
    if not isinstance(value, str):
        message = (
            f"user(request) returned a {type(value).__name__}; return the user's name "
            "(a str), or None when nobody is signed in"
        )
        log.error("%s; the request is denied", message)
        raise ResolverError(message)
    # its text as a plain str: a str subclass's methods (strip, __str__...) never run, here
    # nor wherever the name is shown or logged later
    return str.__str__(value).strip() or None


def _unreadable(name: str, value: Any, exc: Exception) -> ResolverError:
    """What ``name(request)`` returned raised when read: denied, logged as a raise is."""
    log.error(
        "%s(request) returned a %s that raised %s when read; the request is denied",
        name,
        type(value).__name__,
        type(exc).__name__,
        exc_info=(type(exc), exc, exc.__traceback__),
    )
    return ResolverError(
        f"The dashboard's {name}(request) returned a {type(value).__name__} that failed when "
        f"read ({type(exc).__name__}); the error is in the server log."
    )


@dataclass
class AuthConfig:
    """The dashboard's login settings (see the module docstring)."""

    password: str | None = None
    token: str | None = None
    user: UserResolver | None = None
    authorize: Authorize | None = None
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    timeout: float = RESOLVER_TIMEOUT
    throttle: LoginThrottle = field(default_factory=LoginThrottle)

    @classmethod
    def build(
        cls,
        *,
        password: str | None,
        token: str | None,
        user: UserResolver | None,
        authorize: Authorize | None,
        secret_key: str | None,
        timeout: float = RESOLVER_TIMEOUT,
    ) -> AuthConfig:
        if password is None:
            password = os.environ.get(PASSWORD_ENV) or None
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        if secret_key is None:
            secret_key = os.environ.get(SECRET_ENV) or None
        if user is not None and (password or token):
            raise ConfigurationError(
                "create_app: give user= (your own login) or password=/token= (the dashboard's "
                "login page), not both"
            )
        for name, fn in (("user", user), ("authorize", authorize)):
            if fn is not None and not callable(fn):
                raise ConfigurationError(f"create_app({name}=...) takes a function of the request")
        if not timeout > 0:
            raise ConfigurationError("create_app(resolver_timeout=...) must be above 0 seconds")
        config = cls(password=password or None, token=token or None, user=user, timeout=timeout)
        config.authorize = authorize
        if secret_key:
            config.secret_key = secret_key
        return config

    @property
    def login_page(self) -> bool:
        """True when the dashboard's own login page signs users in."""
        return bool(self.password or self.token)

    @property
    def login_methods(self) -> list[str]:
        """The shared secrets the login page accepts: ``password`` and/or ``token``."""
        return [k for k, v in (("password", self.password), ("token", self.token)) if v]

    @property
    def configured(self) -> bool:
        """True when some login protects the dashboard (required off loopback)."""
        return self.login_page or self.user is not None

    def check_secret(self, given: str) -> str | None:
        """Which secret ``given`` matches ("password" or "token"), compared in constant time."""
        encoded = given.encode()
        matched = None
        for kind, secret in (("password", self.password), ("token", self.token)):
            if secret and hmac.compare_digest(encoded, secret.encode()):
                matched = kind
        return matched


def is_loopback_host(host: str) -> bool:
    """True when ``host`` (an address or name) only ever means this machine."""
    host = host.strip().strip("[]")
    if not host:
        return False
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def is_loopback_address(address: str | None) -> bool:
    """True for a literal loopback client address (never resolves a name)."""
    if not address:
        return False
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


PROXY_HEADERS = frozenset(
    {"forwarded", "via", "x-real-ip", "x-client-ip", "true-client-ip", "cf-connecting-ip"}
)
"""Headers a reverse proxy adds (with every ``X-Forwarded-*``): see :func:`proxy_header`."""


def proxy_header(names: Iterable[str]) -> str | None:
    """The first of ``names`` (header names) that only a proxy sends, or None.

    Without a login the dashboard serves loopback clients only; a reverse proxy on the same
    host connects from 127.0.0.1 too, so a request it forwards must be told apart by these.
    """
    for name in names:
        lowered = name.lower()
        if lowered in PROXY_HEADERS or lowered.startswith("x-forwarded-"):
            return name
    return None


def host_header_name(value: str) -> str:
    """The host part of a ``Host`` header: ``[::1]:8080`` -> ``::1``, ``a:80`` -> ``a``."""
    value = value.strip()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback_host_header(value: str) -> bool:
    name = host_header_name(value).lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    return is_loopback_address(name)


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def csrf_matches(expected: str | None, given: str | None) -> bool:
    if not expected or not given:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def clean_user_name(value: str | None, default: str, limit: int = 64) -> str:
    """A name for the audit log: printable, trimmed to ``limit`` characters."""
    text = "".join(ch for ch in (value or "") if ch.isprintable()).strip()[:limit]
    return text or default


def header_user(header: str, *, trusted: Iterable[str]) -> UserResolver:
    """A ``user=`` resolver for a reverse proxy that authenticates users itself.

    The proxy (oauth2-proxy, Authelia, nginx ``auth_request``, ...) puts the user's name in
    ``header`` (``X-Forwarded-User``, ``Remote-User``, ...). The header is believed only on a
    connection from one of the ``trusted`` addresses or networks (``"127.0.0.1"``,
    ``"10.0.0.0/8"``): anyone else could send it too. The proxy must set (not append to)
    the header on every request it forwards.
    """
    if not header.strip():
        raise ConfigurationError("header_user: name the header your proxy sets")
    networks = []
    for entry in trusted:
        try:
            networks.append(ipaddress.ip_network(str(entry).strip(), strict=False))
        except ValueError:
            raise ConfigurationError(
                f"header_user: trusted proxy {entry!r} is not an address or network "
                "(e.g. '127.0.0.1' or '10.0.0.0/8')"
            ) from None
    if not networks:
        raise ConfigurationError("header_user: list the trusted proxies' addresses")
    name = header.strip().lower()

    def resolve(request: Any) -> str | None:
        client = request.client.host if request.client else ""
        if not address_in(client, networks):
            return None
        return request.headers.get(name, "").strip() or None

    return resolve


def address_in(address: str, networks: Iterable[Any]) -> bool:
    """True when the literal ``address`` lies in one of ``networks``."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return False
    return any(ip in network for network in networks)


def refuse_open_bind(host: str, auth: AuthConfig) -> None:
    """Raise ConfigurationError for a non-loopback ``host`` when no login protects it."""
    if auth.configured or is_loopback_host(host):
        return
    raise ConfigurationError(
        f"refusing to serve the dashboard on {host!r} without a login: anyone who can reach "
        f"that address could replay, discard and cancel jobs. Set {PASSWORD_ENV} or "
        f"{TOKEN_ENV} (or pass --password/--token), or bind 127.0.0.1"
    )
