"""Transient store faults for the guarantee tests: a proxy in front of an App's backend
that makes chosen Backend calls raise the error the real store raises when a connection
breaks or the file is locked (issue 16, the store-fault sweep).

::

    store = FaultyStore.install(app, spare=threading.current_thread())
    store.plan = FailFirst("job_claim", 2)      # or RandomFaults(seed, p)
    ...
    store.plan = None                           # the faults heal

A fault is one of two kinds:

- ``request``: the call never reached the store (nothing written), then it raises;
- ``reply``: the store did the work and committed, and the answer was lost on the way
  back (PostgreSQL only: a local SQLite call that committed does not then fail).

Each raises what the backend itself raises (``sqlite3.OperationalError('database is
locked')``, ``psycopg.OperationalError``), which :func:`errands.errors.is_transient`
takes for a passing fault. The ``ctx.transaction()`` calls fail the way the backends do:
whatever breaks, the transaction is rolled back and its connection given back.

Calls from the ``spare`` thread (the test's own enqueues and reads) pass through
untouched and unrecorded, so only the worker's own calls are counted and faulted.
"""

from __future__ import annotations

import random
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import errands
from errands.backends.base import Backend

Kind = Literal["request", "reply"]

# Every method of the Backend protocol: the calls the proxy can fault.
PROTOCOL_METHODS = frozenset(
    name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")
)


def transient_error(backend: Any) -> Exception:
    """The error ``backend`` raises when its store is briefly out of reach."""
    if isinstance(getattr(backend, "path", None), str):  # SQLite: the file is locked
        return sqlite3.OperationalError("database is locked (injected fault)")
    import psycopg

    return psycopg.OperationalError(
        "consuming input failed: server closed the connection unexpectedly (injected fault)"
    )


@dataclass(frozen=True)
class Fault:
    """One injected fault: the call, its kind and its arguments."""

    method: str
    kind: Kind
    args: tuple[Any, ...]
    lost: Any = None  # a lost reply: what the store answered


class FaultPlan(Protocol):
    def decide(self, method: str, args: tuple[Any, ...], replies: bool) -> Kind | None:
        """The fault to inject into this call, ``method(*args)``, or None.

        ``replies``: whether a lost reply is possible on this store."""
        ...


@dataclass
class FailFirst:
    """Fail the first ``n`` calls of ``method``; on a store that can lose replies the
    faults alternate, a lost request first."""

    method: str
    n: int
    injected: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def decide(self, method: str, args: tuple[Any, ...], replies: bool) -> Kind | None:
        if method != self.method:
            return None
        with self._lock:
            if self.injected >= self.n:
                return None
            self.injected += 1
            return "reply" if replies and self.injected % 2 == 0 else "request"

    @property
    def spent(self) -> bool:
        return self.injected >= self.n


@dataclass
class RandomFaults:
    """Fail each call of ``methods`` with probability ``p`` (seeded; the interleaving of
    the worker's threads still varies from run to run)."""

    seed: int
    p: float
    methods: frozenset[str] = PROTOCOL_METHODS
    _random: random.Random = field(init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def decide(self, method: str, args: tuple[Any, ...], replies: bool) -> Kind | None:
        if method not in self.methods:
            return None
        with self._lock:
            if self._random.random() >= self.p:
                return None
            return "reply" if replies and self._random.random() < 0.5 else "request"


@dataclass
class FailOnce:
    """Fail the first call of ``method`` whose arguments satisfy ``when``, with ``kind``."""

    method: str
    kind: Kind
    when: Callable[[tuple[Any, ...]], bool]
    _armed: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def decide(self, method: str, args: tuple[Any, ...], replies: bool) -> Kind | None:
        if method != self.method or (self.kind == "reply" and not replies):
            return None
        with self._lock:
            if not self._armed or not self.when(args):
                return None
            self._armed = False
            return self.kind


class FaultyStore:
    """The backend seen through faults: every Backend method is wrapped, everything else
    (``url``, ``capabilities``, a backend's own attributes) passes through."""

    def __init__(self, real: Any, *, spare: threading.Thread | None = None) -> None:
        self.real = real
        self.spare = spare
        self.replies = not isinstance(getattr(real, "path", None), str)  # PostgreSQL
        self.plan: FaultPlan | None = None
        self.calls: Counter[str] = Counter()  # every call of the worker's, faulted or not
        self.faults: list[Fault] = []
        self.healed: Counter[str] = Counter()  # calls that succeeded after one faulted
        self._lock = threading.Lock()
        for name in PROTOCOL_METHODS:
            if callable(getattr(real, name, None)):
                setattr(self, name, self._wrap(name))

    @classmethod
    def install(cls, app: errands.App, *, spare: threading.Thread | None = None) -> FaultyStore:
        """Put a proxy in front of ``app``'s backend (opening it first)."""
        store = cls(app.backend, spare=spare)
        app._backend = store  # type: ignore[assignment]
        return store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def faulted(self, method: str) -> list[Fault]:
        with self._lock:
            return [f for f in self.faults if f.method == method]

    def _wrap(self, name: str) -> Callable[..., Any]:
        method = getattr(self.real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is self.spare:
                return method(*args, **kwargs)
            plan = self.plan
            kind = plan.decide(name, args, self.replies) if plan is not None else None
            if kind is None:
                result = method(*args, **kwargs)
                with self._lock:
                    self.calls[name] += 1
                    if any(f.method == name for f in self.faults):
                        self.healed[name] += 1
                return result
            lost = self._fail(name, kind, args, kwargs)
            with self._lock:
                self.calls[name] += 1
                self.faults.append(Fault(name, kind, args, lost))
            raise transient_error(self.real)

        return call

    def _fail(self, name: str, kind: Kind, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What the store does before the fault: nothing (a lost request) or the whole
        call (a lost reply); ``ctx.transaction()`` calls always roll back and give the
        connection back, as the backends do whatever breaks. Returns the lost answer."""
        real = self.real
        if name == "tx_rollback" or (name == "tx_finish" and kind == "request"):
            real.tx_rollback(args[0] if args else kwargs["conn"])
        elif kind == "reply" and name != "tx_begin":  # a lost tx_begin reply opened nothing
            return getattr(real, name)(*args, **kwargs)
        return None


def job_ids(faults: Iterable[Fault]) -> set[int]:
    """The jobs named by faulted calls (``step_store(job_id, ...)``, lease references)."""
    found: set[int] = set()
    for fault in faults:
        for arg in fault.args:
            if isinstance(arg, int):
                found.add(arg)
            elif isinstance(arg, list | tuple):
                found.update(a.id for a in arg if hasattr(a, "id"))
    return found
