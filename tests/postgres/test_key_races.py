"""A keyed enqueue whose key another caller frees between its statements inserts again.

The insert is tried first; only when its key is taken are the expired key's release and
the holder's lookup run, each a statement of its own (outside a transaction, each its own
commit). Here another caller deletes the holder (as the pruning of a finished job does)
just before the release runs: nothing to release, nobody holding the key; the enqueue
must then store its job, not fail looking up a holder that is gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import errands
from errands.backends.postgres.backend import PostgresBackend
from errands.backends.postgres.config import parse_postgres_url
from errands.errors import DatabaseBusy

from .counting import statements


@pytest.fixture
def app(pg_url: str) -> Iterator[errands.App]:
    app = errands.App(pg_url)
    yield app
    app.close()


def _free_the_key_before_the_release(
    monkeypatch: pytest.MonkeyPatch, app: errands.App, key: str
) -> list[str]:
    """Another caller deletes the job holding ``key`` just before the release runs."""
    backend: Any = app.backend
    freed: list[str] = []
    release = PostgresBackend._expire_keys

    def racing(self: PostgresBackend, requests: Any) -> Any:
        if any(r.key == key for r in requests) and not freed:
            url = parse_postgres_url(app.url)
            with psycopg.connect(url.conninfo, autocommit=True) as other:
                other.execute(
                    f'DELETE FROM "{backend.schema}".errands_jobs WHERE idempotency_key = %s',
                    (key,),
                )
            freed.append(key)
        return (yield from release(self, requests))

    monkeypatch.setattr(PostgresBackend, "_expire_keys", racing)
    return freed


def test_a_single_keyed_enqueue_inserts_again_when_the_holder_is_gone(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="race.single")
    def job(n: int) -> None: ...

    first = job.enqueue(n=1, key="k")
    freed = _free_the_key_before_the_release(monkeypatch, app, "k")
    second = job.enqueue(n=2, key="k")
    assert freed == ["k"]
    assert second.deduplicated is False and second.id != first.id
    assert second.job().idempotency_key == "k" and second.job().args == {"n": 2}


def test_a_batchs_keyed_job_inserts_again_when_the_holder_is_gone(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.job(name="race.batch")
    def job(n: int) -> None: ...

    first = job.enqueue(n=1, key="k")
    held = job.enqueue(n=2, key="held")
    freed = _free_the_key_before_the_release(monkeypatch, app, "k")
    again, same, new = app.enqueue_many(
        [job.bind(n=3, key="k"), job.bind(n=4, key="held"), job.bind(n=5)]
    )
    assert freed == ["k"]
    assert (again.deduplicated, same.deduplicated, new.deduplicated) == (False, True, False)
    assert again.id != first.id and same.id == held.id
    assert again.job().args == {"n": 3}


def test_a_keyed_enqueue_whose_key_keeps_changing_hands_gives_up_with_a_clear_error(
    app: errands.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken at every insert, held by nobody at every lookup (other callers freeing and
    taking it in between, every time): after KEY_TRIES rounds the enqueue stops with an
    error that names the job and the key, and stores nothing."""

    @app.job(name="race.endless")
    def job(n: int) -> None: ...

    job.enqueue(n=1, key="k")

    def nobody(self: PostgresBackend, requests: Any) -> Any:
        yield from ()
        return {}

    monkeypatch.setattr(PostgresBackend, "_key_holders", nobody)
    with pytest.raises(DatabaseBusy, match=r"race\.endless with key 'k'.*nothing was stored"):
        job.enqueue(n=2, key="k")
    assert [j.args for j in app.backend.job_find_by_key("k")] == ['{"n": 1}']


def test_a_keyed_batch_of_taken_keys_costs_as_many_statements_for_200_keys_as_for_2(
    app: errands.App,
) -> None:
    """The keys a batch finds taken are released (if their period is over) and their
    holders looked up one statement each for all of them: one key at a time, 5,000
    taken keys took 14 times as long as 5,000 new ones (two round trips a key)."""

    @app.job(name="race.taken")
    def job(n: int) -> None: ...

    def taken_again(count: int) -> list[str]:
        batch = [job.bind(n=n, key=f"{count}:{n}") for n in range(count)]
        first = app.enqueue_many(batch)
        again, sent = statements(lambda: app.enqueue_many(batch))
        assert [h.id for h in again] == [h.id for h in first]
        assert all(h.deduplicated for h in again)
        return sent

    assert len(taken_again(200)) == len(taken_again(2)) <= 6


def test_a_keyed_batch_that_stores_nothing_wakes_no_worker(app: errands.App) -> None:
    """A batch whose keys are all taken stores nothing and sends no NOTIFY, even when
    one is due (the last was longer ago than the notify window): it woke every idle
    worker of its queue for nothing, and whether it did hung on timing."""

    @app.job(name="race.woken")
    def job(n: int) -> None: ...

    batch = [job.bind(n=n, key=f"woken:{n}") for n in range(3)]
    app.enqueue_many(batch)
    app.backend._last_notify.clear()  # type: ignore[attr-defined]  # a NOTIFY is due
    again, sent = statements(lambda: app.enqueue_many(batch))
    assert all(h.deduplicated for h in again)
    assert not [s for s in sent if "pg_notify" in s], sent


def test_a_keyed_enqueue_that_stores_nothing_leaves_the_next_enqueue_its_notify(
    app: errands.App,
) -> None:
    """One job whose key is taken stores nothing and sends no NOTIFY; the next enqueue
    to its queue, within the notify window, sends one: the deduplicated enqueue had
    recorded the queue as notified, and the job really stored woke no idle worker."""

    @app.job(name="race.next_woken")
    def job(n: int) -> None: ...

    job.enqueue(n=0, key="taken")
    backend: Any = app.backend
    backend.config = dataclasses.replace(backend.config, notify_window=60.0)
    backend._last_notify.clear()  # a NOTIFY is due
    with psycopg.connect(backend.config.conninfo, autocommit=True) as listener:
        listener.execute(f'LISTEN "{backend.channel}"')
        assert job.enqueue(n=0, key="taken").deduplicated
        assert [n.payload for n in listener.notifies(timeout=0.5)] == []
        job.enqueue(n=1, key="new")
        heard = [n.payload for n in listener.notifies(timeout=5.0, stop_after=1)]
    assert heard == [job.queue], heard
