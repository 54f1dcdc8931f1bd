"""Job definitions: option checks at ``@app.job`` and at enqueue."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

import errands
from errands import ConfigurationError
from errands.retry import DEFAULT_BACKOFF


def _handler(user_id: int) -> None: ...


def _define(app: errands.App, **options: Any) -> errands.JobDefinition[Any, Any]:
    options.setdefault("name", "t.job")
    return app.job(**options)(_handler)  # type: ignore[no-any-return]


def test_defaults_give_three_retries_default_backoff_and_the_default_queue(
    app: errands.App,
) -> None:
    """A bare @app.job is named after its function, on the default queue, 4 attempts."""
    job = app.job(_handler)
    assert job.name == f"{__name__}._handler"
    assert (job.queue, job.priority, job.retries, job.max_attempts) == ("default", 0, 3, 4)
    assert job.backoff is DEFAULT_BACKOFF
    assert (job.timeout, job.lease, job.permanent, job.sensitive) == (None, None, (), frozenset())
    assert app.registry[job.name] is job


def test_definition_is_still_callable_as_the_plain_function(app: errands.App) -> None:
    """Calling the definition runs the handler in-process, with no job involved."""

    @app.job(name="t.double")
    def double(n: int) -> int:
        return n * 2

    assert double(21) == 42


def test_options_are_converted_from_timedeltas(app: errands.App) -> None:
    """timeout and lease accept timedeltas and are kept in seconds."""
    job = _define(app, timeout=timedelta(minutes=2), lease=timedelta(seconds=90), retries=0)
    assert (job.timeout, job.lease, job.max_attempts) == (120.0, 90.0, 1)


@pytest.mark.parametrize("retries", [-1, 1.5, "3", None])
def test_retries_must_be_a_whole_number_of_at_least_zero(app: errands.App, retries: Any) -> None:
    """Negative, fractional or non-numeric retries are refused at definition."""
    with pytest.raises(ConfigurationError, match="retries="):
        _define(app, retries=retries)


@pytest.mark.parametrize("lease", [0.5, 0, timedelta(milliseconds=200)])
def test_lease_must_be_at_least_one_second(app: errands.App, lease: Any) -> None:
    """A lease shorter than a second cannot be heartbeated safely."""
    with pytest.raises(ConfigurationError, match="lease must be at least 1 second"):
        _define(app, lease=lease)


@pytest.mark.parametrize("option", ["lease", "timeout"])
def test_negative_durations_are_refused(app: errands.App, option: str) -> None:
    """A negative lease or timeout is a configuration error naming the option."""
    with pytest.raises(ConfigurationError, match=f"{option}=-5"):
        _define(app, **{option: -5})


@pytest.mark.parametrize("bad", ["ValueError", 42, int, ValueError("instance")])
def test_permanent_takes_only_exception_classes(app: errands.App, bad: Any) -> None:
    """permanent= entries that are not exception classes are refused, naming the entry."""
    with pytest.raises(ConfigurationError, match="permanent= takes exception classes"):
        _define(app, permanent=(KeyError, bad))


@pytest.mark.parametrize("bad", [ValueError, KeyError])
def test_a_bare_exception_class_as_permanent_is_a_configuration_error_showing_the_tuple(
    app: errands.App, bad: type[BaseException]
) -> None:
    """permanent=ValueError (not a tuple) names the option and the form to write."""
    with pytest.raises(ConfigurationError) as caught:
        _define(app, permanent=bad)
    message = str(caught.value)
    assert f"permanent={bad.__name__}" in message
    assert f"permanent=({bad.__name__},)" in message


@pytest.mark.parametrize("option", ["timeout", "lease", "unique_for"])
@pytest.mark.parametrize("bad", ["30s", "30", True, [30]])
def test_a_duration_given_as_text_is_a_configuration_error_naming_the_accepted_forms(
    app: errands.App, option: str, bad: Any
) -> None:
    """timeout="30s" is refused at definition: seconds as a number, or a timedelta."""
    with pytest.raises(ConfigurationError) as caught:
        _define(app, **{option: bad})
    message = str(caught.value)
    assert f"job 't.job': {option}={bad!r}" in message
    assert "number of seconds or a datetime.timedelta" in message
    assert f"{option}=timedelta(seconds=30)" in message


@pytest.mark.parametrize("far", [float("inf"), 1e12, timedelta(days=5_000_000)])
def test_a_delay_too_far_to_read_back_as_a_date_is_refused_at_enqueue_and_at_edit(
    app: errands.App, far: Any
) -> None:
    """A delay of infinity or of millions of days was stored, and every read of the job
    then failed (year out of range): refused now, at enqueue and at edit, with the bound."""
    job = _define(app)
    with pytest.raises(ConfigurationError, match="at most 100 years"):
        job.enqueue(user_id=1, delay=far)
    assert app.jobs() == []
    handle = job.enqueue(user_id=1, delay=60)
    with pytest.raises(ConfigurationError, match="at most 100 years"):
        app.edit([handle.id], delay=far)
    assert app.get_job(handle.id).run_at is not None  # still readable, unchanged


def test_a_run_at_no_time_zone_could_read_back_as_a_date_is_refused(app: errands.App) -> None:
    """9999-12-31T23:59:59-12:00 is year 10000 in UTC: it was stored, and every listing
    of the store then failed ("year 10000 is out of range"), the dashboard's included."""
    far = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-12)))
    job = _define(app)
    with pytest.raises(ConfigurationError, match=r"run_at.*out of range"):
        job.enqueue(user_id=1, run_at=far)
    handle = job.enqueue(user_id=1, delay=60)
    with pytest.raises(ConfigurationError, match=r"edit: run_at.*out of range"):
        app.edit([handle.id], run_at=far)
    assert [j.id for j in app.jobs()] == [handle.id]


@pytest.mark.parametrize("option", ["fair_key", "concurrency_key"])
def test_a_key_built_from_a_sensitive_parameter_is_refused(app: errands.App, option: str) -> None:
    """A key is stored and shown as it is (the tenants page, the fair key metrics' label):
    one built from a sensitive parameter showed what sensitive= masks everywhere else."""

    def handler(email: str, account: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"is built from \['email'\]"):
        app.job(name=f"t.{option}", sensitive={"email"}, **{option: "user:{email}"})(handler)
    app.job(name=f"t.{option}.ok", sensitive={"email"}, **{option: "acct:{account}"})(handler)


@pytest.mark.parametrize("option", ["fair_key", "concurrency_key"])
@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("a:{account!x}", r"'!x' is no conversion; use !s, !r or !a"),
        ("a:{account:zz}", r"format spec ':zz' of field 'account' fits no int value"),
        ("a:{tenant:d}", r"format spec ':d' of field 'tenant' fits no str value"),
        ("a:{tenant!r:d}", r"format spec ':d' of field 'tenant' fits no str value"),
        ("a:{}", r"has a field without a name \('\{\}'\)"),
        ("a:{tenant:>{width}}", r"names \['width'\], which are not parameters"),
    ],
)
def test_a_key_template_every_enqueue_would_fail_on_is_refused_at_definition(
    app: errands.App, option: str, template: str, message: str
) -> None:
    """A conversion other than !s, !r, !a, a format spec the parameter's type cannot
    take, a field without a name: each passed the definition and failed every enqueue."""

    def handler(account: int, tenant: str = "t") -> None: ...

    with pytest.raises(ConfigurationError, match=message):
        app.job(name=f"t.{option}", **{option: template})(handler)
    assert f"t.{option}" not in app.registry


@pytest.mark.parametrize(
    "template", ["a:{account:08d}", "a:{tenant!r}", "a:{account!s:>5}", "a:{tenant:>{account}}"]
)
def test_key_templates_with_conversions_and_format_specs_build_their_keys(
    app: errands.App, db_url: str, template: str
) -> None:
    def handler(account: int, tenant: str = "t") -> None: ...

    job = app.job(name="t.spec", concurrency_key=template)(handler)
    job.enqueue(account=7)
    with contextlib.closing(sqlite3.connect(db_url.removeprefix("sqlite:///"))) as conn:
        [(stored,)] = conn.execute("SELECT concurrency_key FROM errands_jobs").fetchall()
    assert stored == template.format(account=7, tenant="t")


def test_a_key_template_that_fails_on_the_arguments_is_invalid_payload_naming_it(
    app: errands.App,
) -> None:
    """``"{tenant[q]}"`` of a str tenant raised a raw TypeError at enqueue; it is
    InvalidPayload naming the template, as a missing key or attribute is, and nothing is
    written."""

    def handler(tenant: str) -> None: ...

    job = app.job(name="t.index", concurrency_key="a:{tenant[q]}")(handler)
    with pytest.raises(
        errands.InvalidPayload,
        match=r"cannot build concurrency_key 'a:\{tenant\[q\]\}' from the arguments: TypeError",
    ):
        job.enqueue(tenant="zz")
    assert app.jobs() == []


def test_a_timeout_of_infinity_is_refused_at_definition(app: errands.App) -> None:
    with pytest.raises(ConfigurationError, match=r"timeout=inf: must be at most 100 years"):
        _define(app, timeout=float("inf"))


def test_durations_accept_numbers_and_timedeltas(app: errands.App) -> None:
    job = _define(app, timeout=timedelta(seconds=30), lease=45)
    assert (job.timeout, job.lease) == (30.0, 45.0)


def test_an_app_option_given_as_text_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"lease='30s': give a number of seconds"):
        errands.App("sqlite:///:memory:", lease="30s")  # type: ignore[arg-type]


def test_sensitive_must_name_parameters(app: errands.App) -> None:
    """sensitive= naming a field the handler lacks is refused, listing the real ones."""
    with pytest.raises(ConfigurationError, match=r"\['email'\].*\['user_id'\]"):
        _define(app, sensitive={"email"})


def test_priority_must_be_an_int(app: errands.App) -> None:
    """A non-integer priority is refused at definition."""
    with pytest.raises(ConfigurationError, match="priority must be an int"):
        _define(app, priority="high")


def test_a_priority_outside_postgresqls_integer_is_refused_on_every_store(
    app: errands.App,
) -> None:
    """2**40 was stored on SQLite and failed deep inside on PostgreSQL: every store now
    takes -2**31 .. 2**31 - 1, checked at definition, at enqueue and at edit."""
    with pytest.raises(ConfigurationError, match="priority must be between"):
        _define(app, priority=2**40)
    job = _define(app)
    with pytest.raises(ConfigurationError, match="priority must be between"):
        job.enqueue(user_id=1, priority=-(2**31) - 1)
    with pytest.raises(ConfigurationError, match="priority must be an int"):
        job.bind(user_id=1, priority=True)
    assert app.jobs() == []
    top = job.enqueue(user_id=1, priority=2**31 - 1)
    assert app.get_job(top.id).priority == 2**31 - 1
    with pytest.raises(ConfigurationError, match="priority must be between"):
        app.edit([top.id], priority=2**31)
    assert app.get_job(top.id).priority == 2**31 - 1


@pytest.mark.parametrize("name", ["1starts-with-digit", "has space", "x" * 201, "a/b"])
def test_job_names_must_be_simple_identifiers(app: errands.App, name: str) -> None:
    """Job names are 1-200 characters of letters, digits, '_', '.', ':' and '-'."""
    with pytest.raises(ConfigurationError, match="job name"):
        _define(app, name=name)


def test_queue_names_are_checked_at_definition(app: errands.App) -> None:
    """An invalid queue name is refused at definition."""
    with pytest.raises(ConfigurationError, match="queue name"):
        _define(app, queue="emails and more")


def test_two_jobs_cannot_share_a_name(app: errands.App) -> None:
    """Registering a second job under a taken name is refused, suggesting name=."""
    _define(app)
    with pytest.raises(ConfigurationError, match="already registered"):
        _define(app)


# -- enqueue options -----------------------------------------------------------------------


def test_run_at_must_carry_a_time_zone(app: errands.App) -> None:
    """A naive run_at is ambiguous and refused with an example of the fix."""
    job = _define(app)
    with pytest.raises(ConfigurationError, match="no time zone"):
        job.bind(user_id=1, run_at=datetime(2030, 1, 1))


def test_run_at_must_be_a_datetime(app: errands.App) -> None:
    """run_at takes a datetime, not a number."""
    job = _define(app)
    with pytest.raises(ConfigurationError, match="run_at= must be a datetime"):
        job.bind(user_id=1, run_at=1_900_000_000)  # type: ignore[arg-type]


def test_delay_and_run_at_together_are_refused(app: errands.App) -> None:
    """A job is scheduled either by delay or by run_at, never both."""
    job = _define(app)
    with pytest.raises(ConfigurationError, match="not both"):
        job.bind(user_id=1, delay=5, run_at=datetime.now(UTC))


def test_negative_delay_is_refused(app: errands.App) -> None:
    """A delay below zero is a configuration error."""
    job = _define(app)
    with pytest.raises(ConfigurationError, match="delay=-1"):
        job.bind(user_id=1, delay=-1)


@pytest.mark.parametrize("key", ["", 42])
def test_key_must_be_a_non_empty_string(app: errands.App, key: Any) -> None:
    """An empty or non-string idempotency key is refused."""
    job = _define(app)
    with pytest.raises(ConfigurationError, match="key= must be a non-empty string"):
        job.bind(user_id=1, key=key)


def test_enqueue_options_land_in_the_request(app: errands.App) -> None:
    """key, delay, run_at, priority and queue given at enqueue override the definition."""
    job = _define(app, queue="emails", priority=1, timeout=30, lease=60)
    at = datetime(2030, 1, 1, tzinfo=UTC)
    scheduled = job.bind(7, key="k:7", run_at=at, priority=9, queue="urgent").request
    assert (scheduled.name, scheduled.queue, scheduled.priority) == ("t.job", "urgent", 9)
    assert (scheduled.key, scheduled.run_at, scheduled.delay) == ("k:7", at.timestamp(), 0.0)
    assert (scheduled.max_attempts, scheduled.timeout, scheduled.lease_seconds) == (4, 30, 60)
    delayed = job.bind(7, delay=timedelta(minutes=5)).request
    assert (delayed.queue, delayed.priority, delayed.delay, delayed.run_at) == (
        "emails",
        1,
        300.0,
        None,
    )


def test_an_invalid_queue_at_enqueue_is_refused(app: errands.App) -> None:
    """queue= at enqueue is checked like a queue at definition."""
    job = _define(app)
    with pytest.raises(ConfigurationError, match="queue name"):
        job.bind(user_id=1, queue="no spaces allowed")


def test_enqueue_many_takes_only_bound_jobs_of_this_app(app: errands.App, db_url: str) -> None:
    """Plain values, or jobs of another App, are refused before anything is written."""
    with pytest.raises(ConfigurationError, match=r"job\.bind"):
        app.enqueue_many([{"user_id": 1}])  # type: ignore[list-item]
    other = errands.App(db_url)
    try:
        foreign = other.job(name="t.other")(_handler)
        with pytest.raises(ConfigurationError, match="belongs to another App"):
            app.enqueue_many([foreign.bind(user_id=1)])
    finally:
        other.close()


def test_enqueue_many_stores_every_job_a_generator_gives(app: errands.App) -> None:
    """A generator is read once: every job it gives is stored and has a handle (it was
    used up by the checks, and nothing was stored while an empty list came back)."""
    job = _define(app)
    handles = app.enqueue_many(job.bind(user_id=i) for i in range(5))
    assert len(handles) == 5
    assert sorted(app.get_job(h.id).args["user_id"] for h in handles) == [0, 1, 2, 3, 4]


def test_aenqueue_many_stores_every_job_a_generator_gives(app: errands.App) -> None:
    job = _define(app)
    handles = asyncio.run(app.aenqueue_many(job.bind(user_id=i) for i in range(3)))
    assert sorted(app.get_job(h.id).args["user_id"] for h in handles) == [0, 1, 2]


@pytest.mark.parametrize("given", ["one", "job", 7])
def test_enqueue_many_refuses_what_is_not_a_collection_of_jobs(
    app: errands.App, given: str | int
) -> None:
    """One bound job, a string or a number: a clear error before anything is written."""
    value: Any = _define(app).bind(user_id=1) if given == "job" else given
    with pytest.raises(ConfigurationError, match="enqueue_many takes"):
        app.enqueue_many(value)
    assert app.jobs() == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lease": 0.5}, "lease"),
        ({"max_payload_bytes": 0}, "max_payload_bytes"),
        ({"poison_after": 0}, "poison_after"),
        ({"default_queue": "bad queue"}, "queue name"),
    ],
)
def test_app_options_are_validated(options: dict[str, Any], message: str) -> None:
    """Bad App settings fail at construction with the option's name."""
    with pytest.raises(ConfigurationError, match=message):
        errands.App("sqlite:///unused.db", **options)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"queue": "emails", "priority": 3, "timeout": 30, "lease": 60, "retries": 0},
        {"sensitive": ["user_id"]},
        {"concurrency_key": "user:{user_id}", "concurrency_limit": 2},
        {"rate": "10/s"},
        {"fair_key": "tenant:{user_id}"},
        {"queue": "fair"},  # a queue the app declares fair: the job's name is its key
    ],
)
def test_a_job_bound_without_options_gets_the_request_the_general_path_builds(
    app: errands.App, options: dict[str, Any]
) -> None:
    """bind() without options takes a short path (bulk enqueue's every job); it must build
    exactly what the path for jobs with options builds from the same definition."""
    from errands.definition import EnqueueOptions

    app.queue("fair", fair=True)
    job = _define(app, **options)
    quick = job.bind(user_id=7).request
    general = job._request(quick.args_json, EnqueueOptions())
    assert quick == general
    assert quick.args_json == '{"user_id":7}' and quick.delay == 0.0


def test_a_job_defined_unique_for_a_period_needs_a_key_at_every_enqueue(
    app: errands.App,
) -> None:
    """unique_for= on the definition says how long a key stays unique: an enqueue without
    a key is refused, on the short path of a bind without options too."""
    job = _define(app, unique_for=60)
    with pytest.raises(ConfigurationError, match="unique_for= applies to a key"):
        job.bind(user_id=1)
    assert job.bind(user_id=1, key="k").request.unique_for == 60.0


def test_a_key_template_reads_a_parameter_left_at_its_default_as_that_default(
    app: errands.App,
) -> None:
    """The payload leaves out a parameter left at its default, and key templates read it
    as None: f.enqueue(1) stored "acct:None" and f.enqueue(1, account="main") "acct:main",
    so the two never shared their concurrency limit or their fair share. Every path that
    builds a key (bind with or without options, a periodic job's slot, an edit) reads the
    default, as the stored JSON would hold it had the caller passed it."""
    since = datetime(2020, 1, 1, tzinfo=UTC)

    @app.job(name="t.acct", concurrency_key="acct:{account}", fair_key="t:{account}:{since}")
    def by_account(n: int, account: str = "main", since: datetime = since) -> None: ...

    expected = ("acct:main", "t:main:2020-01-01T00:00:00Z")
    requests = {
        "left out": by_account.bind(1).request,
        "passed": by_account.bind(1, account="main", since=since).request,
        "left out, with options": by_account.bind(1, key="k", priority=2).request,
    }
    for how, request in requests.items():
        assert (request.concurrency_key, request.fair_key) == expected, how

    app.periodic("0 * * * *", args={"n": 1})(by_account)
    slot = app.schedules["t.acct"].for_slot(datetime(2030, 1, 1, tzinfo=UTC)).request
    assert (slot.concurrency_key, slot.fair_key) == expected

    handle = by_account.enqueue(1, delay=3600)
    app.edit([handle.id], queue="elsewhere")  # the keys are built again from the stored row
    row = app.backend.job_get(handle.id)
    assert row is not None and row.fair_key == expected[1]


def test_a_job_unique_for_a_period_without_a_key_says_to_pass_key_at_each_enqueue(
    app: errands.App,
) -> None:
    """The error told to give the job a key template, @app.job(key='order:{order_id}',
    unique_for=...), which itself raises TypeError (@app.job takes no key=). It names what
    works: key= at each enqueue (enqueue, bind, ctx.enqueue)."""
    job = _define(app, unique_for=60)
    with pytest.raises(ConfigurationError) as caught:
        job.enqueue(user_id=1)
    message = str(caught.value)
    assert "@app.job(key=" not in message
    assert 'pass key= at each enqueue of the job, as in _handler.enqueue(..., key=f"' in message
    assert "_handler.bind(..., key=...) and ctx.enqueue(_handler, ..., key=...)" in message
    with pytest.raises(TypeError):
        app.job(key="order:{user_id}", unique_for=60)  # type: ignore[call-overload]
    assert not job.enqueue(user_id=1, key="order:1").deduplicated
    assert job.enqueue(user_id=1, key="order:1").deduplicated


@pytest.mark.parametrize("queue", ["", 0, False])
def test_an_empty_or_non_string_queue_is_refused_instead_of_meaning_the_default(
    app: errands.App, queue: Any
) -> None:
    """queue="" or queue=0 given at enqueue (or to @app.job) silently put the job in the
    default queue, where the workers meant to run it may not look. Only None means "the
    job's queue"; anything else must be a queue name."""
    job = _define(app, queue="emails")
    for enqueue in (job.bind, job.enqueue):
        with pytest.raises(ConfigurationError, match="queue name") as caught:
            enqueue(user_id=1, queue=queue)
        if not isinstance(queue, str):
            assert f"is a {type(queue).__name__}, not a string" in str(caught.value)
    with pytest.raises(ConfigurationError, match="queue name"):
        _define(app, name="t.other", queue=queue)
    assert app.jobs() == []
    assert job.bind(user_id=1, queue=None).request.queue == "emails"


@pytest.mark.parametrize(
    ("huge", "digits"),
    [
        (10**400, "an int of 401"),
        (-(10**400), "a negative int of 401"),
        (10**5000, "an int of 5,001"),
    ],
    ids=["10**400", "-10**400", "10**5000"],
)
def test_a_delay_or_priority_past_every_float_is_refused_naming_the_option_and_its_range(
    app: errands.App, huge: int, digits: str
) -> None:
    """delay=10**400 raised a raw OverflowError (it cannot be a float), and an int of more
    than 4,300 digits a raw ValueError from the message itself (Python will not write it
    out); each is refused like any other out-of-range value, naming the option and the
    accepted range, at enqueue, at definition and at edit."""
    job = _define(app)
    bound = "must be >= 0" if huge < 0 else "must be at most 100 years (3,155,760,000 s)"
    with pytest.raises(ConfigurationError) as caught:
        job.enqueue(user_id=1, delay=huge)
    assert f"t.job: delay=<{digits} digits>: {bound}" in str(caught.value)
    with pytest.raises(ConfigurationError, match=f"timeout=<.*{bound[:12]}"):
        _define(app, name="t.other", timeout=huge)
    with pytest.raises(ConfigurationError, match="priority must be between"):
        job.enqueue(user_id=1, priority=huge)
    handle = job.enqueue(user_id=1, delay=60)
    with pytest.raises(ConfigurationError, match="delay=<"):
        app.edit([handle.id], delay=huge)
    assert [j.id for j in app.jobs()] == [handle.id]
