"""Parsing what users type: worker queue specs, database URLs, backend schemes."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

import errands
from errands import ConfigurationError
from errands.backends import open_backend
from errands.backends.sqlite.backend import parse_sqlite_url
from errands.worker.worker import parse_queues

# -- worker queue specs --------------------------------------------------------------------


def test_parse_queues_reads_names_with_per_queue_limits() -> None:
    """ "emails=10,payments=2" gives each queue its own concurrency."""
    assert parse_queues("emails=10,payments=2") == {"emails": 10, "payments": 2}


def test_parse_queues_leaves_the_limit_open_when_none_is_given() -> None:
    """A queue without '=N' has no per-queue limit; spaces and empty items are ignored."""
    assert parse_queues(" emails , payments=3,,") == {"emails": None, "payments": 3}


def test_parse_queues_accepts_lists_and_mappings() -> None:
    """The Python API takes a list of specs or a mapping as well as a string."""
    assert parse_queues(["emails", "payments=2"]) == {"emails": None, "payments": 2}
    assert parse_queues({"emails": 4}) == {"emails": 4}
    assert parse_queues(None) == {}


@pytest.mark.parametrize("spec", ["emails=ten", "emails=1.5"])
def test_parse_queues_rejects_a_limit_that_is_not_a_whole_number(spec: str) -> None:
    """The limit after '=' must be an integer; the error shows the expected form."""
    with pytest.raises(ConfigurationError, match="as in emails=10"):
        parse_queues(spec)


def test_parse_queues_reads_an_empty_limit_as_no_limit() -> None:
    """ "emails=" is the same as "emails"."""
    assert parse_queues("emails=") == {"emails": None}


@pytest.mark.parametrize("spec", ["emails=0", "emails=-2", {"emails": 0}])
def test_parse_queues_rejects_a_limit_below_one(spec: object) -> None:
    """A queue concurrency of zero or less would never run anything."""
    with pytest.raises(ConfigurationError, match="at least 1"):
        parse_queues(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"emails": "3"}, r"must be a whole number \(an int\) of at least 1, got '3'"),
        ({"emails": True}, r"must be a whole number \(an int\) of at least 1, got True"),
        ({"emails": 2.0}, r"must be a whole number \(an int\) of at least 1, got 2.0"),
        ({"emails": 10_001}, "is 10,001: at most 10,000"),
        ("emails=99999999999999", "is 99,999,999,999,999: at most 10,000"),
    ],
)
def test_parse_queues_refuses_a_limit_that_is_not_an_int_or_above_the_maximum(
    spec: object, message: str
) -> None:
    """``{"emails": "3"}`` raised a raw TypeError, True ran as 1, and emails=10**14 started
    threads until the machine refused ("can't start new thread")."""
    with pytest.raises(ConfigurationError, match=message):
        parse_queues(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"concurrency": True}, r"concurrency \(-c\) must be a whole number .*got True"),
        ({"concurrency": 1.5}, r"concurrency \(-c\) must be a whole number .*got 1.5"),
        ({"concurrency": "4"}, r"concurrency \(-c\) must be a whole number .*got '4'"),
        ({"concurrency": 10**9}, r"concurrency \(-c\) is 1,000,000,000: at most 10,000"),
        ({"queues": {"a": 6000, "b": 6000}}, r"per-queue limits\) is 12,000: at most 10,000"),
        ({"express": 10_001}, r"express \(--express\) is 10,001: at most 10,000"),
        ({"express": True}, r"express \(--express\) must be a whole number .*got True"),
    ],
)
def test_a_worker_refuses_a_thread_count_not_an_int_or_above_the_maximum_before_any_starts(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    """``concurrency=10**9`` started some 22,000 threads, then failed with "can't start
    new thread" and left them running; True ran as 1. Refused before any thread starts."""
    app = errands.App(f"sqlite:///{tmp_path}/e.db")
    before = set(threading.enumerate())
    try:
        with pytest.raises(ConfigurationError, match=message):
            app.worker(**{"queues": "a", **options})  # type: ignore[arg-type]
        assert set(threading.enumerate()) - before == set()
    finally:
        app.close()


def test_handler_threads_the_machine_cannot_start_are_refused_and_the_started_ones_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below the maximum a machine may still refuse threads (its ulimit): the worker's
    start fails with a ConfigurationError naming -c, and the threads it did start end
    (they were left running)."""
    from errands.worker.runners import ThreadRunner

    real_start = threading.Thread.start
    started: list[threading.Thread] = []

    def start_two(self: threading.Thread) -> None:
        if self.name.startswith("errands-job") and len(started) >= 2:
            raise RuntimeError("can't start new thread")
        if self.name.startswith("errands-job"):
            started.append(self)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_two)
    with pytest.raises(ConfigurationError, match=r"could not start 5 handler threads .*Lower -c"):
        ThreadRunner(5)
    for thread in started:
        thread.join(10)
        assert not thread.is_alive()


@pytest.mark.parametrize(
    ("prefetch", "message"),
    [
        (10_001, r"prefetch \(--prefetch\) is 10,001: at most 10,000 \(each is a job claimed"),
        (10**9, r"is 1,000,000,000: at most 10,000 .*raise -c or run more workers"),
        (-1, r"prefetch \(--prefetch\) must be a whole number \(an int\) of at least 0, got -1"),
        (True, r"prefetch \(--prefetch\) must be a whole number .*got True"),
        ("8", r"prefetch \(--prefetch\) must be a whole number .*got '8'"),
        (2.5, r"prefetch \(--prefetch\) must be a whole number .*got 2.5"),
    ],
)
def test_a_worker_refuses_a_prefetch_not_an_int_or_above_the_maximum_before_any_thread_starts(
    tmp_path: Path, prefetch: object, message: str
) -> None:
    """``prefetch=10**9`` was taken as given: with quick handlers one claim took a whole
    backlog into the worker (held, leased, heartbeated) while other workers idled; "8"
    raised a raw TypeError and True ran as 1. Refused, naming the option, the bound and
    what to do instead, before any thread starts."""
    app = errands.App(f"sqlite:///{tmp_path}/e.db")
    before = set(threading.enumerate())
    try:
        with pytest.raises(ConfigurationError, match=message):
            app.worker(prefetch=prefetch)  # type: ignore[arg-type]
        assert set(threading.enumerate()) - before == set()
        assert app.worker(concurrency=1, prefetch=10_000).prefetch == 10_000  # the bound: fine
    finally:
        app.close()


def test_the_default_prefetch_of_a_wide_worker_stays_within_the_maximum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defaults (4 x -c, and a fair queue's 16 x -c) are held to the same 10,000: at
    -c 10,000 a worker prefetched 40,000 jobs (a fair queue's, 160,000)."""
    import errands.worker.worker as worker_module

    class NoThreads:  # (10,000 handler threads are not what this test is about)
        def __init__(self, *args: object, **kwargs: object) -> None: ...

        def shutdown(self, *args: object, **kwargs: object) -> None: ...

    monkeypatch.setattr(worker_module, "ThreadRunner", NoThreads)
    app = errands.App(f"sqlite:///{tmp_path}/e.db")
    app.queue("tenants", fair=True)
    try:
        wide = app.worker(concurrency=10_000, queues=["default", "tenants"], express=0)
        assert (wide.prefetch, wide.fair_prefetch) == (10_000, 10_000)
        narrow = app.worker(concurrency=3, queues=["default", "tenants"], express=0)
        assert (narrow.prefetch, narrow.fair_prefetch) == (12, 48)  # as before
    finally:
        app.close()


@pytest.mark.parametrize(
    ("processes", "message"),
    [
        (1_025, r"processes \(--processes\) is 1,025: at most 1,024 \(each is a worker process"),
        (100_000, r"is 100,000: at most 1,024 .*raise -c, or run workers on more hosts"),
        (0, r"processes \(--processes\) must be a whole number \(an int\) of at least 1"),
        (True, r"processes \(--processes\) must be a whole number .*got True"),
    ],
)
def test_a_supervisor_refuses_a_process_count_not_an_int_or_above_the_maximum(
    processes: object, message: str
) -> None:
    """``Supervisor(command, 100_000)`` (what ``--processes 100000`` builds) was taken as
    given: it started interpreters until the machine ran out of memory. Refused before any
    child starts."""
    from errands.worker.supervisor import Supervisor

    with pytest.raises(ConfigurationError, match=message):
        Supervisor(["true"], processes)  # type: ignore[arg-type]
    assert Supervisor(["true"], 1_024).processes == 1_024


def test_the_cli_refuses_too_many_processes_before_it_imports_the_app() -> None:
    """``errands worker --processes 100000`` exits 1 with one line naming the option, the
    bound and what to do, before the app is imported (this app does not even exist) and
    before any child starts."""
    from click.testing import CliRunner

    from errands.cli.main import cli

    result = CliRunner().invoke(
        cli, ["worker", "no_such_module_anywhere:app", "--processes", "100000"]
    )
    assert result.exit_code == 1, result.output
    assert "processes (--processes) is 100,000: at most 1,024" in result.output
    assert "no_such_module_anywhere" not in result.output


@pytest.mark.parametrize("spec", ["", " ", ",", " , ,", [], [""], {}])
def test_parse_queues_refuses_a_spec_that_names_no_queue(spec: object) -> None:
    """An empty -q (an unset $QUEUE) was read as no -q at all: the worker silently served
    every queue. Only None (no -q) means that now; an empty spec says how to fix it."""
    with pytest.raises(ConfigurationError, match=r"name no queue .*leave -q out to serve every"):
        parse_queues(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["=5", "emails,=5"])
def test_parse_queues_refuses_a_limit_without_a_queue_name(spec: str) -> None:
    with pytest.raises(ConfigurationError, match="no queue name before '='"):
        parse_queues(spec)


@pytest.mark.parametrize(
    ("option", "value", "bound"),
    [
        ("grace", math.nan, "(0 or more)"),
        ("grace", math.inf, "(0 or more)"),
        ("grace", -1.0, "(0 or more)"),
        ("poll_interval", math.nan, "above 0"),
        ("poll_interval", math.inf, "above 0"),
        ("poll_interval", 0, "above 0"),
        ("maintenance_tick", math.nan, "above 0"),
        ("maintenance_tick", -math.inf, "above 0"),
        ("abandon_after", math.inf, "(0 or more)"),
        ("abandon_after", math.nan, "(0 or more)"),
        ("abandon_after", -1.0, "(0 or more)"),
    ],
)
def test_a_worker_refuses_a_nan_or_infinite_duration_naming_the_option(
    tmp_path: Path, option: str, value: float, bound: str
) -> None:
    """``app.worker(poll_interval=nan)`` passed the bounds check (NaN compares false
    with either bound) and made a worker that never slept between claims; ``grace=inf``
    one whose shutdown never ended, and ``abandon_after=inf`` one whose shutdown never
    ended while a durable step ran (the stop waits up to abandon_after for it). The
    embedded workers of the Flask and FastAPI integrations take these options from the
    caller too."""
    app = errands.App(f"sqlite:///{tmp_path}/e.db")
    try:
        with pytest.raises(ConfigurationError) as caught:
            app.worker(**{option: value})
    finally:
        app.close()
    assert str(caught.value) == (
        f"{option}={value!r}: give a finite number of seconds {bound}, such as {option}=1"
    )


# -- SQLite URLs ---------------------------------------------------------------------------


def test_sqlite_url_with_three_slashes_is_a_relative_path() -> None:
    """sqlite:///errands.db names errands.db in the working directory."""
    assert parse_sqlite_url("sqlite:///errands.db") == ("errands.db", {})


def test_sqlite_url_with_four_slashes_is_an_absolute_path() -> None:
    """sqlite:////var/lib/errands.db names an absolute file."""
    assert parse_sqlite_url("sqlite:////var/lib/errands.db") == ("/var/lib/errands.db", {})


def test_sqlite_url_options_are_read_from_the_query() -> None:
    """Known options travel in the query string."""
    path, options = parse_sqlite_url("sqlite:///x.db?synchronous=FULL&busy_timeout_ms=100")
    assert (path, options) == ("x.db", {"synchronous": "FULL", "busy_timeout_ms": "100"})


def test_sqlite_url_with_a_host_part_is_rejected_with_the_fix() -> None:
    """sqlite://errands.db (two slashes) is a common slip; the error shows both forms."""
    with pytest.raises(ConfigurationError, match="three slashes"):
        parse_sqlite_url("sqlite://errands.db")


def test_sqlite_url_without_a_file_is_rejected() -> None:
    """A URL naming no file says how to write one."""
    with pytest.raises(ConfigurationError, match="names no file"):
        parse_sqlite_url("sqlite:///")


def test_sqlite_url_with_an_unknown_option_is_rejected_listing_the_known_ones() -> None:
    """A typo in an option is an error, never silently ignored."""
    with pytest.raises(ConfigurationError, match=r"unknown option.*synchronus.*known: synchronous"):
        parse_sqlite_url("sqlite:///x.db?synchronus=FULL")


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("synchronous=SOMETIMES", "choose one of"),
        ("busy_timeout_ms=soon", "busy_timeout_ms must be a whole number"),
        ("write_timeout=forever", "write_timeout a number of seconds"),
        ("write_timeout=-1", "write_timeout more than 0"),
        ("write_timeout=nan", "write_timeout more than 0"),
        ("busy_timeout_ms=-5", "busy_timeout_ms must be 0 to 3600000"),
    ],
)
def test_sqlite_backend_rejects_bad_option_values(tmp_path: Path, query: str, message: str) -> None:
    """Option values are checked when the backend opens, before any file is created."""
    with pytest.raises(ConfigurationError, match=message):
        open_backend(f"sqlite:///{tmp_path}/x.db?{query}")
    assert not (tmp_path / "x.db").exists()


def test_sqlite_backend_refuses_a_missing_folder(tmp_path: Path) -> None:
    """A database in a folder that does not exist is refused rather than failing later."""
    with pytest.raises(ConfigurationError, match="does not exist; create it first"):
        open_backend(f"sqlite:///{tmp_path}/missing/x.db")


# -- schemes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["mysql://db/shop", "redis://localhost", "errands.db", "", "http://x"]
)
def test_open_backend_rejects_unknown_schemes_with_the_supported_forms(url: str) -> None:
    """An unsupported URL is refused with examples of the ones that work."""
    with pytest.raises(ConfigurationError, match="sqlite:///") as info:
        open_backend(url)
    assert "ERRANDS_URL" in str(info.value)


@pytest.mark.parametrize("window", ["nan", "inf", "-1", "1e9"])
def test_a_postgres_notify_window_outside_zero_to_a_minute_is_refused(window: str) -> None:
    """nan, inf or a negative notify_window turned every NOTIFY off without a word."""
    from errands.backends.postgres.config import parse_postgres_url

    with pytest.raises(ConfigurationError, match="notify_window"):
        parse_postgres_url(f"postgresql://u@h/db?notify_window={window}")
    assert parse_postgres_url("postgresql://u@h/db?notify_window=0").notify_window == 0.0


def test_postgres_connections_find_a_silently_dropped_link_within_a_minute_by_default() -> None:
    """Keepalives and a TCP user timeout unless the URL sets them (libpq's own keepalive
    begins after 2 hours: a LISTEN connection dropped by a NAT stayed 'listening')."""
    from urllib.parse import parse_qs, urlsplit

    from errands.backends.postgres.config import parse_postgres_url

    given = parse_qs(urlsplit(parse_postgres_url("postgresql://u@h/db").conninfo).query)
    assert given["keepalives_idle"] == ["30"] and given["tcp_user_timeout"] == ["60000"]
    own = parse_postgres_url("postgresql://u@h/db?keepalives_idle=5&sslmode=require").conninfo
    mine = parse_qs(urlsplit(own).query)
    assert mine["keepalives_idle"] == ["5"] and mine["sslmode"] == ["require"]


def test_a_libpq_option_with_a_space_is_passed_on_as_libpq_reads_it() -> None:
    """``options=-c name=value``: its space was passed on as '+', which libpq keeps as is
    (the server refused "+name"), so no option with a space could be given in the URL."""
    from errands.backends.postgres.config import parse_postgres_url

    url = "postgresql://u@h/db?options=-c%20statement_timeout%3D5s&schema=s"
    conninfo = parse_postgres_url(url).conninfo
    assert "options=-c%20statement_timeout%3D5s" in conninfo and "+" not in conninfo


@pytest.mark.parametrize(
    "options",
    [{"maintenance_tick": 0}, {"pool": "process", "app_path": "x:app", "express": 2}],
    ids=["maintenance_tick", "express_with_processes"],
)
def test_a_worker_refused_for_its_options_leaves_no_handler_thread_running(
    tmp_path: Path, options: dict[str, object]
) -> None:
    """Checked before its handler threads start: they were started first, and a worker
    refused for a bad maintenance_tick (or an express lane with the process pool) left
    its -c threads running for the life of the process."""
    app = errands.App(f"sqlite:///{tmp_path}/t.db")
    before = threading.active_count()
    with pytest.raises(errands.ConfigurationError):
        app.worker(concurrency=20, **options)  # type: ignore[arg-type]
    assert threading.active_count() == before
    app.close()
