"""Payloads: arguments validated from type hints, stored as JSON, decoded again."""

from __future__ import annotations

import enum
import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Annotated, Any

import pytest
from pydantic import AfterValidator, BaseModel, Field

import errands
from errands import ConfigurationError, Context, InvalidPayload
from errands.backends.base import ListParams
from errands.jobs import JobRow
from errands.payload import RESERVED_OPTIONS, mask


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(BaseModel):
    street: str
    zip: str


@dataclass
class Line:
    sku: str
    qty: int


class Opaque:
    """A class pydantic has no schema for."""


def _args(bound: errands.BoundJob) -> dict[str, Any]:
    return json.loads(bound.request.args_json)  # type: ignore[no-any-return]


# -- validation at enqueue -------------------------------------------------------------


def test_invalid_argument_raises_invalid_payload_naming_the_field(app: errands.App) -> None:
    """A value that fails its type hint is reported with the parameter's name."""

    @app.job(name="t.send")
    def send(user_id: int, email: str) -> None: ...

    with pytest.raises(InvalidPayload, match="user_id") as info:
        send.bind(user_id="forty-two", email="a@b.c")
    assert info.value.errors and info.value.errors[0]["loc"] == ("user_id",)


def test_invalid_enqueue_writes_nothing(app: errands.App) -> None:
    """An enqueue that fails validation leaves the store without a job."""

    @app.job(name="t.send")
    def send(user_id: int) -> None: ...

    with pytest.raises(InvalidPayload):
        send.enqueue(user_id="x")
    assert app.backend.job_list(ListParams()) == []


def test_missing_argument_is_reported_by_name(app: errands.App) -> None:
    """A required parameter left out is named in the error."""

    @app.job(name="t.send")
    def send(user_id: int, email: str) -> None: ...

    with pytest.raises(InvalidPayload, match="email: Field required"):
        send.bind(user_id=1)


def test_unknown_argument_is_rejected(app: errands.App) -> None:
    """An argument the handler has no parameter for is an error, not silently dropped."""

    @app.job(name="t.send")
    def send(user_id: int) -> None: ...

    with pytest.raises(InvalidPayload, match="emial: unexpected argument"):
        send.bind(user_id=1, emial="a@b.c")


def test_positional_arguments_bind_to_parameters_in_order(app: errands.App) -> None:
    """Positional arguments map onto the handler's parameters, skipping the Context."""

    @app.job(name="t.charge")
    def charge(ctx: Context, order_id: int, amount: Decimal) -> None: ...

    assert _args(charge.bind(7, Decimal("9.99"))) == {"order_id": 7, "amount": "9.99"}


def test_too_many_positional_arguments_are_rejected(app: errands.App) -> None:
    """More positional values than parameters is an error listing the parameters."""

    @app.job(name="t.send")
    def send(user_id: int) -> None: ...

    with pytest.raises(InvalidPayload, match=r"takes 1 argument\(s\) \(user_id\), got 2"):
        send.bind(1, 2)


def test_an_argument_given_positionally_and_by_name_is_rejected(app: errands.App) -> None:
    """The same parameter cannot be given twice."""

    @app.job(name="t.send")
    def send(user_id: int) -> None: ...

    with pytest.raises(InvalidPayload, match="'user_id' given twice"):
        send.bind(1, user_id=1)


def test_defaults_are_not_stored_when_not_given(app: errands.App) -> None:
    """Only the arguments passed are stored; defaults apply again at execution."""

    @app.job(name="t.send")
    def send(user_id: int, urgent: bool = False) -> None: ...

    bound = send.bind(user_id=1)
    assert _args(bound) == {"user_id": 1}
    assert send.payload.decode(bound.request.args_json) == {"user_id": 1, "urgent": False}


# -- the Context parameter ---------------------------------------------------------------


def test_context_parameter_is_not_part_of_the_payload(app: errands.App) -> None:
    """A parameter annotated Context is injected by the worker, not stored."""

    @app.job(name="t.charge")
    def charge(ctx: Context, order_id: int) -> None: ...

    assert charge.payload.fields == ("order_id",)
    assert charge.payload.context_param == "ctx"


def test_context_parameter_cannot_be_passed_by_the_caller(app: errands.App) -> None:
    """Passing the Context parameter by name is refused with an explanation."""

    @app.job(name="t.charge")
    def charge(ctx: Context, order_id: int) -> None: ...

    with pytest.raises(InvalidPayload, match="'ctx' is the job's Context"):
        charge.bind(ctx=None, order_id=1)


# -- definition-time checks ----------------------------------------------------------------


@pytest.mark.parametrize("option", ["key", "delay", "run_at", "priority", "queue", "conn"])
def test_parameters_named_like_enqueue_options_are_rejected_at_definition(
    app: errands.App, option: str
) -> None:
    """key, delay, run_at, priority, queue and conn belong to enqueue, not to handlers."""
    assert option in RESERVED_OPTIONS
    namespace: dict[str, Any] = {}
    exec(f"def handler({option}: int) -> None: ...", namespace)
    with pytest.raises(ConfigurationError, match=f"parameter '{option}' clashes"):
        app.job(name="t.clash")(namespace["handler"])


def test_var_positional_parameters_are_rejected_at_definition(app: errands.App) -> None:
    """*args cannot be a durable payload."""

    def handler(*items: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"\*items"):
        app.job(name="t.varargs")(handler)


def test_var_keyword_parameters_are_rejected_at_definition(app: errands.App) -> None:
    """**kwargs cannot be a durable payload."""

    def handler(**extra: int) -> None: ...

    with pytest.raises(ConfigurationError, match="named parameter"):
        app.job(name="t.varkw")(handler)


def test_parameter_of_a_type_without_json_form_is_rejected_at_definition(
    app: errands.App,
) -> None:
    """A parameter type pydantic cannot store as JSON fails when the job is defined."""

    def handler(thing: Opaque) -> None: ...

    with pytest.raises(ConfigurationError, match="cannot be stored as JSON"):
        app.job(name="t.opaque")(handler)


def test_return_type_without_json_form_is_rejected_at_definition(app: errands.App) -> None:
    """The result is stored too, so its type must have a JSON form."""

    def handler(n: int) -> Opaque: ...

    with pytest.raises(ConfigurationError, match="return type"):
        app.job(name="t.opaque_result")(handler)


def test_unresolvable_type_hint_is_rejected_at_definition(app: errands.App) -> None:
    """A forward reference that names nothing is a configuration error, not a crash."""

    def handler(n: NoSuchType) -> None: ...  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(ConfigurationError, match="cannot resolve the type hints"):
        app.job(name="t.unresolved")(handler)


# -- size limit --------------------------------------------------------------------------


def test_payload_over_the_size_limit_is_rejected_with_sizes_and_a_fix(db_url: str) -> None:
    """An oversized payload says how big it is, the limit, and what to do instead."""
    small = errands.App(db_url, max_payload_bytes=100)
    try:

        @small.job(name="t.blob")
        def blob(text: str) -> None: ...

        with pytest.raises(InvalidPayload) as info:
            blob.bind(text="x" * 200)
        message = str(info.value)
        assert "over the limit of 100" in message
        assert "211 bytes" in message
        assert "pass a reference" in message
        blob.bind(text="x" * 50)  # under the limit: fine
    finally:
        small.close()


# -- round trips ---------------------------------------------------------------------------


def test_rich_argument_types_survive_encode_and_decode(app: errands.App) -> None:
    """datetime, UUID, Decimal, enum, pydantic models and dataclasses come back as such."""

    @app.job(name="t.rich")
    def rich(
        at: datetime,
        ref: uuid.UUID,
        amount: Decimal,
        colour: Colour,
        address: Address,
        lines: list[Line],
        note: str | None = None,
    ) -> None: ...

    values = {
        "at": datetime(2024, 5, 17, 12, 30, 15, 123456, tzinfo=UTC),
        "ref": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "amount": Decimal("1234.5600"),
        "colour": Colour.BLUE,
        "address": Address(street="1 Main St", zip="90210"),
        "lines": [Line("sku-1", 2), Line("sku-2", 1)],
    }
    text = rich.payload.encode(values)
    json.loads(text)  # plain JSON, nothing pickled
    decoded = rich.payload.decode(text)
    assert decoded == {**values, "note": None}
    assert type(decoded["amount"]) is Decimal and type(decoded["ref"]) is uuid.UUID
    assert decoded["at"].utcoffset() == timedelta(0)


def test_corrupted_stored_json_fails_decoding_with_invalid_payload(app: errands.App) -> None:
    """A payload that is no longer valid JSON fails permanently at execution."""

    @app.job(name="t.send")
    def send(user_id: int) -> None: ...

    with pytest.raises(InvalidPayload, match="stored payload fails validation"):
        send.payload.decode('{"user_id": 1')


def test_stored_payload_that_no_longer_fits_the_hints_fails_decoding(app: errands.App) -> None:
    """An old payload whose field no longer validates is reported by field name."""

    @app.job(name="t.send")
    def send(user_id: int) -> None: ...

    with pytest.raises(InvalidPayload, match="user_id"):
        send.payload.decode('{"user_id": "not a number"}')
    with pytest.raises(InvalidPayload, match="object"):
        send.payload.decode("[1, 2]")


# -- results -----------------------------------------------------------------------------


def test_result_round_trips_through_its_return_type(app: errands.App) -> None:
    """A typed result is stored as JSON and decoded back to its type."""

    @app.job(name="t.when")
    def when(n: int) -> datetime: ...

    at = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    text = when.payload.encode_result(at)
    assert text == '"2024-01-02T03:04:05Z"'
    assert when.payload.decode_result(json.loads(text or "null")) == at


def test_none_result_is_stored_as_no_result(app: errands.App) -> None:
    """A handler returning None stores nothing and reads back None."""

    @app.job(name="t.noop")
    def noop(n: int) -> None: ...

    assert noop.payload.encode_result(None) is None
    assert noop.payload.decode_result(None) is None


def test_a_result_over_the_default_16_mib_limit_is_refused_naming_max_result_bytes(
    app: errands.App,
) -> None:
    """The default limit on a result's JSON: 16 MiB; at it a result is stored, past it
    refused, in bytes of UTF-8, naming the option that raises it."""

    @app.job(name="t.big")
    def big(n: int) -> str: ...

    limit = 16 * 1024 * 1024
    assert app.max_result_bytes == limit
    assert len(big.payload.encode_result("x" * (limit - 2)) or "") == limit  # (quoted)
    with pytest.raises(InvalidPayload, match=r"App\(max_result_bytes=\.\.\.\)"):
        big.payload.encode_result("é" * (limit // 2))  # 2 bytes each, with its quotes


def test_max_result_bytes_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="max_result_bytes"):
        errands.App("sqlite:///:memory:", max_result_bytes=0)


def test_result_without_json_form_raises_invalid_payload(app: errands.App) -> None:
    """An untyped handler returning an arbitrary object gets a clear error."""

    @app.job(name="t.untyped")
    def untyped(n: int):  # type: ignore[no-untyped-def]
        return None

    with pytest.raises(InvalidPayload, match="returned a object"):
        untyped.payload.encode_result(object())


def test_stored_result_that_no_longer_fits_its_type_is_returned_raw(app: errands.App) -> None:
    """Reading an old result of another type gives the raw value rather than failing."""

    @app.job(name="t.count")
    def count(n: int) -> int: ...

    assert count.payload.decode_result("not a number") == "not a number"
    assert count.payload.decode_result(5) == 5


# -- masking -----------------------------------------------------------------------------


def test_mask_hides_only_sensitive_fields_and_copies() -> None:
    """Sensitive values become ***; others stay; the input is not modified."""
    args = {"user_id": 1, "email": "a@b.c", "card": "4242"}
    assert mask(args, {"email", "card"}) == {"user_id": 1, "email": "***", "card": "***"}
    assert args["email"] == "a@b.c"
    unmasked = mask(args, ())
    assert unmasked == args and unmasked is not args


def test_sensitive_fields_travel_in_meta_and_mask_job_args(app: errands.App) -> None:
    """sensitive= is stored in the job's meta, and Job.masked_args hides those fields."""

    @app.job(name="t.send", sensitive={"email"})
    def send(user_id: int, email: str) -> None: ...

    bound = send.bind(user_id=1, email="a@b.c")
    assert bound.request.meta == {"sensitive": ["email"]}
    job = _row(bound.request.args_json, json.dumps(bound.request.meta)).to_job()
    assert job.args == {"user_id": 1, "email": "a@b.c"}
    assert job.masked_args == {"user_id": 1, "email": "***"}


def test_masked_args_of_a_job_without_sensitive_fields_shows_everything() -> None:
    """No sensitive= means no masking."""
    job = _row('{"a": 1}', "{}").to_job()
    assert job.masked_args == {"a": 1}


def test_masked_args_hides_a_corrupted_payload_of_a_sensitive_job() -> None:
    """When the args cannot be parsed, a job with sensitive fields shows none of them."""
    job = _row('{"email": "a@b', '{"sensitive": ["email"]}').to_job()
    assert job.masked_args == {"__corrupt__": "***"}


def test_the_idempotency_key_of_a_sensitive_job_with_a_corrupted_payload_is_masked() -> None:
    """Its sensitive values cannot be read from the payload to be found in the key: the
    key is hidden whole, as the arguments are (it was shown raw)."""
    job = replace(_row('{"email": "a@b', '{"sensitive": ["email"]}'), idempotency_key="w:a@b.c")
    assert job.to_job().masked_key == "***"
    readable = _row('{"email": "a@b.c"}', '{"sensitive": ["email"]}')
    assert replace(readable, idempotency_key="w:a@b.c").to_job().masked_key == "w:***"


def _row(args: str, meta: str) -> JobRow:
    return JobRow(
        id=1,
        name="t.send",
        queue="default",
        args=args,
        meta=meta,
        state="available",
        priority=0,
        attempt=0,
        max_attempts=4,
        run_at=0.0,
        idempotency_key=None,
        errors="[]",
        result=None,
        inserted_at=0.0,
        attempted_at=None,
        finished_at=None,
        lease_owner=None,
        lease_token=None,
        lease_expires_at=None,
        rescues=0,
        cancel_requested=0,
        timeout=None,
        lease_seconds=None,
        discarded_by=None,
        discard_reason=None,
    )


def test_masked_args_hides_args_that_are_not_an_object_for_a_sensitive_job() -> None:
    """Valid JSON of the wrong shape is hidden as a whole when the job has sensitive fields."""
    job = _row('["a@b.c"]', '{"sensitive": ["email"]}').to_job()
    assert job.masked_args == {"__corrupt__": "***"}


def test_masked_args_shows_a_corrupted_payload_of_a_job_without_sensitive_fields() -> None:
    """With nothing sensitive, the raw corrupted text is shown to help debugging."""
    job = _row('{"n": 1', "{}").to_job()
    assert job.masked_args == {"__corrupt__": '{"n": 1'}


@pytest.mark.parametrize("name", ["_private", "model_config", "model_dump"])
def test_parameter_names_pydantic_cannot_hold_are_rejected_at_definition(
    app: errands.App, name: str
) -> None:
    """A parameter that could never be passed is refused when the job is defined."""
    namespace: dict[str, Any] = {}
    exec(f"def handler({name}: int) -> None: ...", namespace)
    with pytest.raises(ConfigurationError, match=f"{name}.*rename"):
        app.job(name="t.unusable")(namespace["handler"])


def test_a_datetime_whose_offset_has_seconds_is_stored_as_the_same_instant_in_utc(
    app: errands.App,
) -> None:
    """JSON writes UTC offsets to the minute; a historical zone's offset with seconds
    (Amsterdam before 1937: +00:19:32) would move the instant, so it is stored in UTC."""

    @app.job(name="remind")
    def remind(at: datetime, also: list[datetime]) -> None: ...

    amsterdam_1930 = timezone(timedelta(minutes=19, seconds=32))
    at = datetime(1930, 5, 1, 9, 0, tzinfo=amsterdam_1930)
    plain = datetime(2030, 5, 1, 9, 0, tzinfo=timezone(timedelta(hours=2)))
    text = remind.payload.encode({"at": at, "also": [at, plain]})
    assert json.loads(text)["at"] == "1930-05-01T08:40:28Z"
    decoded = remind.payload.decode(text)
    assert decoded["at"] == at and decoded["also"] == [at, plain]
    assert decoded["also"][1].utcoffset() == timedelta(hours=2)  # whole minutes: kept


@pytest.fixture
def store(each_store_url: str) -> Iterator[errands.App]:
    """An App on each store: a refused payload must be refused before either sees it."""
    application = errands.App(each_store_url)
    yield application
    application.close()


def test_an_int_too_long_to_read_back_from_json_is_refused_at_enqueue_naming_the_field(
    store: errands.App,
) -> None:
    """An int of more than 4,300 digits was stored (a payload of ints, strings and bools
    skipped the re-read check) but never ran: no worker could decode it, its arguments
    read {'__corrupt__': ...}; on PostgreSQL 10**200000 failed the insert with a raw
    NumericValueOutOfRange. Refused at enqueue, naming the field and the limit, on the
    short path (int parameters) and the round trip's (a list[int], Any) alike."""

    @store.job(name="t.big")
    def big(n: int, label: str = "") -> None: ...

    @store.job(name="t.bigs")
    def bigs(ns: list[int], anything: Any = None) -> None: ...

    longest = -(10**4300 - 1)  # 4,300 digits (and a sign): read back as it was
    handle = big.enqueue(longest, label="x" * 5000)
    row = store.backend.job_get(handle.id)
    assert row is not None and big.payload.decode(row.args)["n"] == longest
    for job, arguments, where in [
        (big, {"n": 10**4300}, "n"),
        (big, {"n": -(10**200000)}, "n"),
        (bigs, {"ns": [1, 10**4300]}, "ns.1"),
        (bigs, {"ns": [], "anything": {"k": [10**5000]}}, "anything.k.0"),
    ]:
        with pytest.raises(InvalidPayload) as caught:
            job.enqueue(**arguments)
        assert f"{where}: an int of more than 4,300 digits" in str(caught.value)
    assert [job.id for job in store.jobs()] == [handle.id]


def test_a_nan_or_infinite_float_under_any_is_refused_at_enqueue_naming_the_field(
    store: errands.App,
) -> None:
    """float parameters refuse NaN and infinity, but under Any or dict[str, Any] they were
    written as null and read back as None: the handler silently got another value.
    Refused at enqueue, naming the field, on both stores."""

    @store.job(name="t.loose")
    def loose(anything: Any = None, extra: dict[str, Any] | None = None) -> None: ...

    for arguments, where in [
        ({"anything": math.nan}, "anything"),
        ({"anything": [1.0, math.inf]}, "anything.1"),
        ({"extra": {"ratio": -math.inf}}, "extra.ratio"),
        ({"extra": {"point": Line("a", 1), "scores": (1.5, math.nan)}}, "extra.scores.1"),
    ]:
        with pytest.raises(InvalidPayload) as caught:
            loose.enqueue(**arguments)
        assert f"{where}: a NaN or infinite float cannot be stored as JSON" in str(caught.value)
    assert store.jobs() == []
    handle = loose.enqueue(anything=[1.5, None], extra={"ratio": 0.25})
    row = store.backend.job_get(handle.id)
    assert row is not None
    assert loose.payload.decode(row.args) == {"anything": [1.5, None], "extra": {"ratio": 0.25}}


@dataclass
class Point:
    x: int


def test_only_payloads_of_builtin_types_are_known_to_decode_without_the_applications_code(
    app: errands.App,
) -> None:
    """An async worker decodes such a payload on its event loop; any type that may run the
    application's code when validated (a model and its validators, an enum, a dataclass,
    Annotated metadata) is decoded in a thread, where a slow or hanging one holds no
    other job."""

    def spec(fn: Any) -> bool:
        return app.job(name=f"p.{fn.__name__}")(fn).payload.decodes_without_user_code

    def plain(
        n: int, s: str, b: bool, f: float, raw: bytes, when: datetime, at: timedelta,
        id: uuid.UUID, d: Decimal, maybe: int | None, items: list[dict[str, int]],
        pair: tuple[int, ...], tags: set[str], anything: Any, bare: list,
    ) -> None: ...  # fmt: skip

    def model(address: Address) -> None: ...
    def colour(c: Colour) -> None: ...
    def nested_model(addresses: list[Address]) -> None: ...
    def maybe_model(address: Address | None) -> None: ...

    def point(p: Point) -> None: ...
    def annotated(n: Annotated[int, AfterValidator(lambda v: v)]) -> None: ...

    def unhashable_metadata(n: Annotated[int, {"doc": "x"}]) -> None: ...
    def factory_default(n: list[int] = Field(default_factory=list)) -> None: ...  # noqa: B008
    def object_default(n: Any = Point(1)) -> None: ...  # noqa: B008
    def plain_defaults(n: int = 1, s: str = "a", m: int | None = None) -> None: ...

    assert spec(plain)
    assert spec(plain_defaults)
    for fn in (
        model, colour, nested_model, maybe_model, point, annotated, unhashable_metadata,
        factory_default, object_default,
    ):  # fmt: skip
        assert not spec(fn), fn.__name__
