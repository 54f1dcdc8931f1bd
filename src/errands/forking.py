"""What starts afresh in a child forked from this process.

A fork copies the forking thread alone, and every lock as it was: one held at that moment
by another thread (which does not exist in the child) is held in the child for good, and
the child's first use of it hangs. So an object with such locks (an App's, its hook
runner's, its event bus's, its fair weight callable's, a result hub's, a PostgreSQL
backend's) is registered here with :func:`reset_at_fork`, and its ``_forked()`` is
called in the child right after the fork, on its only thread (``os.register_at_fork``):
there it puts in new locks and forgets what the parent's threads were doing.
``_forked()`` does no I/O and no logging (the logging module's locks may be copied held
too), and is quick. A module-level lock is named here with :func:`fresh_lock_at_fork`:
the child has a new one in its place.

The objects are held weakly: one dropped is collected as before.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Protocol, TypeVar


class Forkable(Protocol):
    def _forked(self) -> None:
        """In a forked child, right after the fork, on its only thread: start afresh."""


F = TypeVar("F", bound=Forkable)

_REGISTERED: weakref.WeakSet[Forkable] = weakref.WeakSet()
# (a module's globals(), the name of a lock there): a new lock in a forked child
_MODULE_LOCKS: list[tuple[dict[str, Any], str]] = []
# Objects whose _forked() raised in this (forked) process: kept referenced for its life,
# never collected half reset (a __del__ could take a lock as the fork copied it).
_FAILED: list[Forkable] = []


def reset_at_fork(obj: F) -> F:
    """Call ``obj._forked()`` in every child forked from this process from now on."""
    _REGISTERED.add(obj)
    return obj


def forget_at_fork(obj: Forkable) -> None:
    """No longer call ``obj._forked()`` in a child forked from now on (it is closed)."""
    _REGISTERED.discard(obj)


def fresh_lock_at_fork(namespace: dict[str, Any], name: str) -> None:
    """In every child forked from this process from now on, ``namespace[name]`` (a
    module's ``globals()``, and the name of a ``threading.Lock`` there) is a new lock,
    put in right after the fork. Its users look it up by name at each use (``with
    _lock:``), so they take the new one."""
    _MODULE_LOCKS.append((namespace, name))


def _after_fork_in_child() -> None:
    """``os.register_at_fork``'s hook, in a forked child (one thread: the forking one).
    The module locks are new first; then each object's ``_forked()`` runs. One that
    raises does not keep the others from theirs, and is kept referenced for the child's
    life (see _FAILED); the first error is raised after them (Python reports it, the
    fork goes on)."""
    for namespace, name in _MODULE_LOCKS:
        namespace[name] = threading.Lock()
    failed: BaseException | None = None
    for obj in list(_REGISTERED):
        try:
            obj._forked()
        except Exception as exc:  # pragma: no cover - none of errands' own raises
            _FAILED.append(obj)
            failed = failed or exc
    if failed is not None:  # pragma: no cover
        raise failed


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
