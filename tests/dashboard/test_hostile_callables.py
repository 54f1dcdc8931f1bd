"""``authorize=`` and ``user=`` are the operator's code, run on every request: the dashboard
treats them as hostile. One that raises, hangs or answers nonsense denies the request with
a logged error; it never grants, never shows a traceback and never hangs the dashboard."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

import errands
from errands.dashboard import create_app

from .helpers import BASE_URL, csrf_of, dead_job

SECRET_IN_ERROR = "postgresql://admin:hunter2@db"  # what a failing resolver might say
TIME_LIMIT = 0.3  # for the resolvers that hang; the others get a slow machine's margin
GENEROUS = 30.0


def behaving(behaviour: str, flavour: str, release: threading.Event) -> Callable[[Any], Any]:
    """A resolver that ``raise``s, ``hang``s or returns a ``bad`` value, ``sync`` or ``async``."""

    def sync_resolver(request: Any) -> Any:
        if behaviour == "raise":
            raise RuntimeError(f"cannot reach {SECRET_IN_ERROR}")
        if behaviour == "hang":
            release.wait(30)
        return 42

    async def async_resolver(request: Any) -> Any:
        if behaviour == "raise":
            raise RuntimeError(f"cannot reach {SECRET_IN_ERROR}")
        if behaviour == "hang":
            await anyio.sleep(30)
        return 42

    return sync_resolver if flavour == "sync" else async_resolver


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown, so a hung sync resolver's thread ends with the test."""
    event = threading.Event()
    yield event
    event.set()


def dashboard_with(
    app: errands.App, which: str, resolver: Callable[[Any], Any], time_limit: float
) -> TestClient:
    """A dashboard whose ``which`` (``user`` or ``authorize``) is ``resolver``."""
    options: dict[str, Any] = {"user": resolver}
    if which == "authorize":
        options = {"user": lambda request: "carol", "authorize": resolver}
    dashboard = create_app(app, resolver_timeout=time_limit, **options)
    return TestClient(dashboard, base_url=BASE_URL, client=("127.0.0.1", 1))


def assert_denied_and_logged(
    response: Any, caplog: pytest.LogCaptureFixture, which: str, says: str
) -> None:
    assert response.status_code == 500
    assert f"{which}(request)" in response.text
    assert "Traceback" not in response.text and SECRET_IN_ERROR not in response.text
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged and logged[0].name == "errands.dashboard"
    assert f"{which}(request)" in logged[0].getMessage() and says in logged[0].getMessage()


Hostile = Callable[[str], tuple[TestClient, str]]


@pytest.fixture(
    params=[("authorize", "sync"), ("authorize", "async"), ("user", "sync"), ("user", "async")],
    ids=lambda param: "-".join(param),
)
def hostile(request: pytest.FixtureRequest, app: errands.App, release: threading.Event) -> Hostile:
    """``hostile(behaviour)``: a client of a dashboard whose resolver misbehaves, and which
    resolver it is (``authorize`` or ``user``; each ``sync`` and ``async``)."""
    which, flavour = request.param

    def make(behaviour: str) -> tuple[TestClient, str]:
        limit = TIME_LIMIT if behaviour == "hang" else GENEROUS
        return dashboard_with(app, which, behaving(behaviour, flavour, release), limit), which

    return make


def test_a_resolver_that_raises_denies_with_a_logged_error(
    app: errands.App, jobs: dict[str, Any], caplog: pytest.LogCaptureFixture, hostile: Hostile
) -> None:
    job_id = dead_job(app, jobs)
    client, which = hostile("raise")
    assert_denied_and_logged(client.get("/"), caplog, which, "RuntimeError")
    assert caplog.records[0].exc_info is not None  # the traceback goes to the log
    replay = client.post(f"/jobs/{job_id}/replay", data={"csrf_token": "x"})
    assert replay.status_code == 500
    assert app.get_job(job_id).state.value == "dead"


def test_a_resolver_that_hangs_is_cut_off_after_the_time_limit_and_denies(
    caplog: pytest.LogCaptureFixture, hostile: Hostile
) -> None:
    client, which = hostile("hang")
    started = time.monotonic()
    response = client.get("/")
    assert time.monotonic() - started < 5
    assert_denied_and_logged(response, caplog, which, f"within {TIME_LIMIT:g} s")


def test_a_resolver_returning_the_wrong_type_is_a_clear_error(
    caplog: pytest.LogCaptureFixture, hostile: Hostile
) -> None:
    client, which = hostile("bad")
    response = client.get("/")
    assert_denied_and_logged(response, caplog, which, "returned a int")
    assert "returned a int" in response.text


class TrappedStr(str):
    """A str whose own methods raise: what a hostile resolver may hand back."""

    def strip(self, chars: str | None = None) -> str:
        raise RuntimeError(f"cannot reach {SECRET_IN_ERROR}")

    def lower(self) -> str:
        raise RuntimeError(f"cannot reach {SECRET_IN_ERROR}")

    def __str__(self) -> str:
        raise RuntimeError(f"cannot reach {SECRET_IN_ERROR}")


class TrappedSet(set[str]):
    def __iter__(self) -> Iterator[str]:
        raise RuntimeError(f"cannot reach {SECRET_IN_ERROR}")


def test_a_str_subclass_answer_is_read_as_its_text_without_running_its_methods(
    app: errands.App, jobs: dict[str, Any]
) -> None:
    """Reading the answer ran outside the guard around the call: a str subclass whose
    strip raised was a bare 500. Its text is read with str's own methods."""
    job_id = dead_job(app, jobs)
    dashboard = create_app(
        app, user=lambda request: TrappedStr(" carol "), authorize=lambda r: TrappedStr("READ")
    )
    client = TestClient(dashboard, base_url=BASE_URL, client=("127.0.0.1", 1))
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200, page.text
    assert "carol" in page.text and ">Replay<" not in page.text  # read only


def test_an_answer_that_raises_when_read_denies_with_a_logged_error(
    app: errands.App, caplog: pytest.LogCaptureFixture
) -> None:
    """A set subclass whose __iter__ raised got past the guard: a bare 500."""
    client = dashboard_with(app, "authorize", lambda request: TrappedSet({"replay"}), GENEROUS)
    response = client.get("/")
    assert_denied_and_logged(response, caplog, "authorize", "TrappedSet that raised")
    assert "RuntimeError" in response.text
    assert caplog.records[0].exc_info is not None  # the traceback goes to the log


def test_a_hung_sync_resolver_does_not_hold_up_other_requests(
    app: errands.App, release: threading.Event
) -> None:
    def authorize(request: Any) -> str:
        if request.query_params.get("hang"):
            release.wait(30)
        return "all"

    dashboard = create_app(
        app, user=lambda request: "carol", authorize=authorize, resolver_timeout=1.0
    )
    with TestClient(dashboard, base_url=BASE_URL) as client:
        for _ in range(3):
            assert client.get("/", params={"hang": "1"}).status_code == 500
        assert client.get("/").status_code == 200


def test_async_and_sync_resolvers_still_work(app: errands.App, jobs: dict[str, Any]) -> None:
    job_id = dead_job(app, jobs)

    async def user(request: Any) -> str:
        return "carol"

    def authorize(request: Any) -> set[str]:
        return {"replay"} if request.state.user == "carol" else set()

    client = TestClient(create_app(app, user=user, authorize=authorize), base_url=BASE_URL)
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200 and ">Replay<" in page.text
    replay = client.post(
        f"/jobs/{job_id}/replay", data={"csrf_token": csrf_of(page.text)}, follow_redirects=False
    )
    assert replay.status_code == 303
    assert app.get_job(job_id).state.value == "available"


def test_a_hung_event_subscriber_does_not_hold_up_an_operators_action(
    app: errands.App, jobs: dict[str, Any], release: threading.Event
) -> None:
    """An action's events reach the app's subscribers (user code) on the events lane: a
    subscriber that hangs on ``errands.job.replayed`` gets the event and the replay
    answers at once. Inline, it held the request, and a thread of the pool, for ever."""
    job_id = dead_job(app, jobs)
    reached = threading.Event()

    def subscriber(event: Any) -> None:
        if event.name == "errands.job.replayed":
            reached.set()
            release.wait(120)

    app.events.subscribe(subscriber)
    client = TestClient(
        create_app(app, user=lambda request: "carol", authorize=lambda request: "all"),
        base_url=BASE_URL,
    )
    page = client.get(f"/jobs/{job_id}")
    answers: list[Any] = []
    replay = threading.Thread(
        target=lambda: answers.append(
            client.post(
                f"/jobs/{job_id}/replay",
                data={"csrf_token": csrf_of(page.text)},
                follow_redirects=False,
            )
        ),
        daemon=True,
    )
    replay.start()
    replay.join(GENEROUS)
    assert answers and answers[0].status_code == 303, "the replay waited for the subscriber"
    assert app.get_job(job_id).state.value == "available"
    assert reached.wait(GENEROUS)  # it got the event all the same
