"""What starts afresh in a child forked from this process.

A fork copies the forking thread alone, and every lock as it was: one held at that moment
by another thread (which does not exist in the child) is held in the child for good, and
the child's first use of it hangs. So an object with such locks (an App's, its hook
runner's, its event bus's, its fair weight callable's) is registered here with
:func:`reset_at_fork`, and its ``_forked()`` is called in the child right after the fork,
on its only thread (``os.register_at_fork``): there it puts in new locks and forgets
what the parent's threads were doing. ``_forked()`` does no I/O and no logging (the
logging module's locks may be copied held too), and is quick.

The objects are held weakly: one dropped is collected as before.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol, TypeVar


class Forkable(Protocol):
    def _forked(self) -> None:
        """In a forked child, right after the fork, on its only thread: start afresh."""


F = TypeVar("F", bound=Forkable)

_REGISTERED: weakref.WeakSet[Forkable] = weakref.WeakSet()


def reset_at_fork(obj: F) -> F:
    """Call ``obj._forked()`` in every child forked from this process from now on."""
    _REGISTERED.add(obj)
    return obj


def _after_fork_in_child() -> None:
    """``os.register_at_fork``'s hook, in a forked child (one thread: the forking one).
    One object's ``_forked()`` that raises does not keep the others from theirs; the
    first error is raised after them (Python reports it, the fork goes on)."""
    failed: BaseException | None = None
    for obj in list(_REGISTERED):
        try:
            obj._forked()
        except Exception as exc:  # pragma: no cover - none of errands' own raises
            failed = failed or exc
    if failed is not None:  # pragma: no cover
        raise failed


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
