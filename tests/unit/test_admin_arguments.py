"""The admin API's arguments (ids, limits, reasons) are checked before a store sees them.

A bad one got a raw driver error (OverflowError on SQLite, NumericValueOutOfRange or
InvalidRowCountInLimitClause on PostgreSQL), an AttributeError or ValueError from
Python, or no error at all (``replay(["5"])`` acted on job 5, ``replay([None])`` said
"no such job"). Now each is a
ConfigurationError saying what was given and what is expected, on every store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import errands
from errands import ConfigurationError

BIG = 2**70
RANGE = "1<=x<=9223372036854775807"  # as the CLI's IntRange words it

Call = Callable[[errands.App], Any]


@pytest.fixture
def store(each_store_url: str) -> Iterator[errands.App]:
    application = errands.App(each_store_url)
    application.migrate()
    yield application
    application.close()


def refused(store: errands.App, call: Call) -> str:
    """The message of the ConfigurationError ``call`` raises (any other error fails)."""
    with pytest.raises(ConfigurationError) as caught:
        call(store)
    return str(caught.value)


ID_PAST_THE_STORE: dict[str, Call] = {
    "replay": lambda a: a.replay([BIG]),
    "discard": lambda a: a.discard([BIG], reason="dup"),
    "jobs before_id": lambda a: a.jobs(before_id=BIG),
    "dead jobs before_id": lambda a: a.jobs(state="dead", before_id=BIG),
    "jobs parent_id": lambda a: a.jobs(parent_id=BIG),
    "cancel": lambda a: a.cancel(BIG),
    "cancel_workflow": lambda a: a.cancel_workflow(BIG),
    "get_job": lambda a: a.get_job(BIG),
    "job_result": lambda a: a.job_result(BIG),
    "job_steps": lambda a: a.job_steps(BIG),
    "audit job_id": lambda a: a.audit(job_id=BIG),
    "signal": lambda a: a.signal(BIG, "go"),
    "edit": lambda a: a.edit([BIG], priority=1),
    "workflow": lambda a: a.workflow(BIG),
    "workflow_status": lambda a: a.workflow_status(BIG),
    "workflow_members": lambda a: a.workflow_members(BIG),
    "workflows before_id": lambda a: a.workflows(before_id=BIG),
}


@pytest.mark.parametrize("call", ID_PAST_THE_STORE.values(), ids=ID_PAST_THE_STORE.keys())
def test_an_id_past_what_a_store_keeps_is_refused_naming_the_range(
    store: errands.App, call: Call
) -> None:
    """2**70 was OverflowError on SQLite and bigint out of range on PostgreSQL."""
    message = refused(store, call)
    assert RANGE in message and str(BIG) in message, message
    assert "id" in message and "pass" in message, message


BAD_LIMITS: dict[str, Call] = {
    "audit -1": lambda a: a.audit(limit=-1),
    "audit 0": lambda a: a.audit(limit=0),
    "audit 2**70": lambda a: a.audit(limit=BIG),
    "audit '10'": lambda a: a.audit(limit="10"),
    "jobs 2**70": lambda a: a.jobs(limit=BIG),
    "jobs 1.5": lambda a: a.jobs(limit=1.5),
    "workflows -1": lambda a: a.workflows(limit=-1),
    "workflows 2**70": lambda a: a.workflows(limit=BIG),
}


@pytest.mark.parametrize("call", BAD_LIMITS.values(), ids=BAD_LIMITS.keys())
def test_a_limit_out_of_range_or_not_an_int_is_refused_naming_the_range(
    store: errands.App, call: Call
) -> None:
    """audit(limit=-1) was InvalidRowCountInLimitClause on PostgreSQL (every row on
    SQLite); a limit of 2**70 an OverflowError or bigint out of range."""
    message = refused(store, call)
    assert message.startswith("limit must be an int in the range " + RANGE), message
    assert "limit=100" in message, message


NOT_AN_ID: dict[str, tuple[Call, str]] = {
    "dead jobs before_id 'x'": (
        lambda a: a.jobs(state="dead", before_id="x"),
        "before_id must be an int in the range",
    ),
    "cancel 'abc'": (lambda a: a.cancel("abc"), "got 'abc', a str"),
    "replay ['5']": (lambda a: a.replay(["5"]), "got '5', a str"),
    "replay [None]": (lambda a: a.replay([None]), "got None"),
    "replay [1.5]": (lambda a: a.replay([1.5]), "got 1.5, a float"),
    "replay [True]": (lambda a: a.replay([True]), "got True, a bool"),
    "replay [0]": (lambda a: a.replay([0]), "got 0"),
    "replay [-3]": (lambda a: a.replay([-3]), "got -3"),
    "replay '12'": (lambda a: a.replay("12"), "replay: ids must be a list of job ids"),
    "replay 5": (lambda a: a.replay(5), "as in replay([42])"),
    "discard ['7']": (lambda a: a.discard(["7"], reason="dup"), "got '7', a str"),
    "edit ['3']": (lambda a: a.edit(["3"], priority=1), "got '3', a str"),
    "get_job 2.0": (lambda a: a.get_job(2.0), "got 2.0, a float"),
    "signal '1'": (lambda a: a.signal("1", "go"), "got '1', a str"),
    "audit job_id '1'": (lambda a: a.audit(job_id="1"), "got '1', a str"),
    "workflow_status '1'": (lambda a: a.workflow_status("1"), "workflow id must be an int"),
}


@pytest.mark.parametrize("call, says", NOT_AN_ID.values(), ids=NOT_AN_ID.keys())
def test_an_id_that_is_not_a_positive_int_is_refused_not_looked_up(
    store: errands.App, call: Call, says: str
) -> None:
    """cancel("abc") was int()'s ValueError; replay(["5"]) acted on job 5, and
    replay([None]) or replay([1.5]) reported "no such job"; before_id="x" was
    InvalidTextRepresentation on PostgreSQL; replay("12") replayed jobs 1 and 2."""
    message = refused(store, call)
    assert says in message, message


def test_a_discard_reason_that_is_not_text_is_refused_naming_the_fix(
    store: errands.App,
) -> None:
    """discard(reason=5) raised AttributeError ('int' object has no attribute 'strip')."""
    for reason in (5, None, b"dup"):
        message = refused(store, lambda a, r=reason: a.discard([1], reason=r))
        assert message.startswith("discard reason must be a string, got "), message
        assert "pass it as text" in message, message


def test_ids_of_any_integer_type_still_act(store: errands.App) -> None:
    """The check takes what Python takes as an integer (an ``__index__``: numpy's int64),
    as a plain int, and ids from a generator."""

    @store.job(name="t.noop")
    def noop() -> None:
        pass

    handle = noop.enqueue(delay=3600)

    class Index:
        def __index__(self) -> int:
            return handle.id

    assert store.get_job(Index()).id == handle.id  # type: ignore[arg-type]
    moved = store.edit((i for i in [handle.id]), priority=5)
    assert moved.matched == [handle.id]
    assert store.cancel(Index()).id == handle.id  # type: ignore[arg-type]
    assert [e.job_id for e in store.audit(job_id=handle.id, limit=1)] == [handle.id]
