"""Property-based tests of payloads (DESIGN §4): every supported argument type survives
enqueue -> store -> decode unchanged, on SQLite and on PostgreSQL (whose jsonb rewrites
numbers and key order); and any value at all either validates or raises InvalidPayload
naming the field, never another exception, never a row that fails at execution.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any, Literal
from uuid import UUID

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typing_extensions import TypedDict

import errands
from errands.definition import JobDefinition

from .support import job_count

# A loaded CI machine must not turn slow generation into a failure.
RELAXED: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
FIELD = "payload_arg"  # distinctive, so "the error names the field" means something


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 10


class Address(BaseModel):
    street: str
    number: int
    tags: list[str] = []


@dataclasses.dataclass
class Point:
    x: float
    y: float
    label: str | None = None


class LineItem(TypedDict):
    sku: str
    quantity: int


# Text PostgreSQL can store: no NUL (refused with InvalidPayload; see the test below) and
# no lone surrogates (hypothesis never generates those unless asked).
text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False)
# Any UTC offset, to the second: JSON holds offsets to the minute, so errands stores a
# value whose offset has seconds (Europe/Amsterdam before 1937: +00:19:32) in UTC instead.
offsets = st.integers(-(24 * 3600 - 1), 24 * 3600 - 1).map(
    lambda secs: timezone(timedelta(seconds=secs))
)
aware = st.datetimes(timezones=st.just(UTC) | offsets)
json_leaf = st.none() | st.booleans() | st.integers() | finite | text

SUPPORTED: dict[str, tuple[Any, st.SearchStrategy[Any]]] = {
    "int": (int, st.integers()),
    "float": (float, finite),
    "str": (str, text),
    "bool": (bool, st.booleans()),
    "optional": (int | None, st.none() | st.integers()),
    "list": (list[int], st.lists(st.integers(), max_size=8)),
    "dict": (dict[str, float], st.dictionaries(text, finite, max_size=6)),
    "nested": (
        dict[str, list[dict[str, int | str | None]]],
        st.dictionaries(
            text,
            st.lists(
                st.dictionaries(text, st.none() | st.integers() | text, max_size=3), max_size=3
            ),
            max_size=3,
        ),
    ),
    "datetime": (datetime, aware),
    "date": (date, st.dates()),
    "time": (time, st.times()),
    "aware_time": (time, st.times(timezones=offsets)),
    "uuid": (UUID, st.uuids()),
    "decimal": (Decimal, st.decimals(allow_nan=False, allow_infinity=False)),
    "enum": (Color, st.sampled_from(Color)),
    "int_enum": (Level, st.sampled_from(Level)),
    "pydantic_model": (
        Address,
        st.builds(Address, street=text, number=st.integers(), tags=st.lists(text, max_size=3)),
    ),
    "dataclass": (Point, st.builds(Point, x=finite, y=finite, label=st.none() | text)),
    "typeddict": (LineItem, st.fixed_dictionaries({"sku": text, "quantity": st.integers()})),
    "literal": (Literal["low", "high", 3], st.sampled_from(["low", "high", 3])),
}

# Anything a caller might pass: wrong types, NaN, NUL, lone surrogates, bytes, objects.
anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.decimals()
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
    | st.binary(max_size=8)
    | st.datetimes()
    | st.uuids()
    | st.sampled_from([object(), {1, 2}, 1j, Color.RED, Level.HIGH, b"\xff", float("nan")]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(), children, max_size=4)
        | st.tuples(children, children)
    ),
    max_leaves=12,
)


def _define(app: errands.App, key: str, annotation: Any) -> JobDefinition[Any, Any]:
    def typed(payload_arg):  # type: ignore[no-untyped-def]  # annotated just below
        return None

    typed.__annotations__ = {FIELD: annotation, "return": None}
    typed.__qualname__ = typed.__name__ = f"accepts_{key}"
    return app.job(name=f"fuzz.{key}", retries=0)(typed)


Jobs = tuple[errands.App, dict[str, JobDefinition[Any, Any]]]


def _app_with_jobs(url: str) -> Jobs:
    app = errands.App(url)
    return app, {key: _define(app, key, annotation) for key, (annotation, _) in SUPPORTED.items()}


@pytest.fixture(scope="module")
def jobs(store_url: str) -> Iterator[Jobs]:
    app, defined = _app_with_jobs(store_url)
    yield app, defined
    app.close()


@pytest.fixture(scope="module")
def sqlite_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """Validation happens before any backend is involved: one backend is enough for junk."""
    app, defined = _app_with_jobs(f"sqlite:///{tmp_path_factory.mktemp('junk')}/errands.db")
    yield app, defined
    app.close()


def _instant(value: datetime | time) -> datetime | time:
    """The UTC instant (for a time of day: the UTC time of day)."""
    if isinstance(value, time):
        return datetime.combine(date(2000, 1, 3), value).astimezone(UTC).time()
    return value.astimezone(UTC)


def _same(decoded: Any, original: Any) -> bool:
    if type(decoded) is not type(original) and not isinstance(original, dict):
        return False
    if isinstance(original, datetime | time) and original.tzinfo is not None:
        offset = original.utcoffset()
        assert offset is not None
        if offset.seconds % 60:  # stored in UTC: the same instant, offset zero
            return _instant(decoded) == _instant(original) and decoded.utcoffset() == timedelta(0)
        return decoded == original and decoded.utcoffset() == offset
    return bool(decoded == original)


@pytest.mark.parametrize("kind", list(SUPPORTED))
def test_every_supported_argument_type_round_trips_through_the_store_unchanged(
    jobs: Jobs, kind: str
) -> None:
    app, defined = jobs
    job = defined[kind]
    strategy = SUPPORTED[kind][1]

    @settings(max_examples=30, **RELAXED)
    @given(value=strategy)
    def round_trip(value: Any) -> None:
        handle = job.enqueue(**{FIELD: value})
        row = app.backend.job_get(handle.id)
        assert row is not None
        decoded = job.payload.decode(row.args)[FIELD]
        assert _same(decoded, value), f"stored {row.args!r}: {decoded!r} != {value!r}"

    round_trip()


@pytest.mark.parametrize("kind", list(SUPPORTED))
def test_any_value_either_validates_for_good_or_raises_invalid_payload_naming_the_field(
    sqlite_jobs: Jobs, kind: str
) -> None:
    """No other exception type escapes enqueue; a refused value writes nothing; an accepted
    one is stored as JSON that validates again at execution."""
    app, defined = sqlite_jobs
    job = defined[kind]

    @settings(max_examples=50, **RELAXED)
    @given(value=anything)
    def junk(value: Any) -> None:
        before = job_count(app)
        try:
            handle = job.enqueue(**{FIELD: value})
        except errands.InvalidPayload as exc:
            assert FIELD in str(exc), str(exc)
            assert job_count(app) == before, "a refused payload wrote a row"
        else:
            row = app.backend.job_get(handle.id)
            assert row is not None
            job.payload.decode(row.args)  # raises if the stored JSON no longer validates

    junk()


nul_text = st.builds(lambda head, tail: f"{head}\x00{tail}", text, text)
unstored = errands.App("sqlite:///:memory:")  # bind() validates without touching the store


@unstored.job(name="fuzz.any")
def takes_any(payload_arg: Any) -> None:
    pass


@unstored.job(name="fuzz.floats")
def takes_floats(
    payload_arg: float = 0.0, many: list[float] | None = None, point: Point | None = None
) -> None:
    pass


@settings(max_examples=30, **RELAXED)
@given(value=nul_text, where=st.sampled_from(["top", "list", "dict_value", "dict_key"]))
def test_text_holding_a_nul_character_is_refused_naming_the_field_on_every_backend(
    value: str, where: str
) -> None:
    """PostgreSQL's jsonb cannot hold \\u0000, so no backend accepts it (portable payloads)."""
    shaped = {
        "top": value,
        "list": ["ok", value],
        "dict_value": {"k": value},
        "dict_key": {value: 1},
    }[where]
    with pytest.raises(errands.InvalidPayload, match=FIELD) as caught:
        takes_any.bind(payload_arg=shaped)
    assert "NUL" in str(caught.value)


@settings(max_examples=30, **RELAXED)
@given(
    value=st.sampled_from([math.nan, -math.nan, math.inf, -math.inf, float("nan")]),
    shape=st.sampled_from(["top", "list", "dataclass"]),
)
def test_nan_and_infinite_floats_are_refused_at_enqueue_instead_of_dying_at_execution(
    value: float, shape: str
) -> None:
    """JSON has no NaN: stored as null, the job would fail its own validation when run."""
    kwargs: dict[str, Any] = {
        "top": {FIELD: value},
        "list": {FIELD: 1.0, "many": [1.0, value]},
        "dataclass": {FIELD: 1.0, "point": Point(value, 1.0)},
    }[shape]
    with pytest.raises(errands.InvalidPayload) as caught:
        takes_floats.bind(**kwargs)
    named = {"top": FIELD, "list": "many", "dataclass": "point"}[shape]
    assert named in str(caught.value)


@settings(max_examples=25, **RELAXED)
@given(extra=st.integers(-3, 3), limit=st.integers(64, 4096))
def test_the_size_limit_is_exact_and_its_error_names_both_sizes(extra: int, limit: int) -> None:
    app = errands.App("sqlite:///:memory:", max_payload_bytes=limit)

    @app.job(name="fuzz.sized")
    def sized(payload_arg: str) -> None:
        pass

    overhead = len('{"payload_arg":""}')
    size = limit + extra
    assume(size >= overhead)
    value = "é" * ((size - overhead) // 2) + "a" * ((size - overhead) % 2)  # 2-byte chars
    if size <= limit:
        sized.bind(payload_arg=value)
    else:
        with pytest.raises(errands.InvalidPayload) as caught:
            sized.bind(payload_arg=value)
        assert f"{size:,} bytes" in str(caught.value) and f"{limit:,}" in str(caught.value)
    app.close()
