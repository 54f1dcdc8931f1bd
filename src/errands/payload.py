"""Job arguments as a durable contract, built from the handler's type hints.

At definition time the handler's signature becomes a pydantic model (one field per
parameter, unknown fields forbidden). At enqueue the arguments are validated and stored as
JSON; at execution the stored JSON is validated again, so an old or corrupted payload
fails permanently instead of reaching the handler. JSON only: nothing is ever pickled.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from types import UnionType
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model
from pydantic.errors import PydanticSchemaGenerationError, PydanticUserError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from .errors import ConfigurationError, InvalidPayload

MAX_PAYLOAD_BYTES_DEFAULT = 256 * 1024
# A handler's result, as stored JSON: a result of hundreds of megabytes crossed a process
# pool's pipe and was stored (a worker of 465 MB RSS for one 200 MB string).
MAX_RESULT_BYTES_DEFAULT = 16 * 1024 * 1024
MASK = "***"

# Names ``enqueue`` and ``bind`` take as options; a handler parameter may not use them.
RESERVED_OPTIONS = frozenset({"key", "delay", "run_at", "priority", "queue", "conn", "unique_for"})

# A NUL character escaped inside JSON text (an even run of backslashes may precede it):
# PostgreSQL's jsonb and text cannot hold it, so no backend stores it.
JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
NUL_FIX = "remove it, or pass binary data base64-encoded"

# The JSON parser that reads a payload back at execution (pydantic's) takes ints of at most
# 4,300 digits, whatever sys.set_int_max_str_digits says, and so does Python's json (the
# listings, the dashboard) by default: a longer int was stored and its job could never run
# (its arguments read {'__corrupt__': ...}); on PostgreSQL 10**200000 failed the insert.
INT_MAX_DIGITS = 4300
_INT_TOO_LONG = 10**INT_MAX_DIGITS
_LONG_DIGITS = re.compile(rf"[0-9]{{{INT_MAX_DIGITS + 1}}}")  # where such an int may be


def holds_nul(text: str) -> bool:
    """Whether JSON text holds an escaped NUL (the substring test first: the regex costs
    more, and almost no text has one)."""
    return "\\u0000" in text and JSON_NUL.search(text) is not None


def nul_path(value: Any) -> str | None:
    """Where in a decoded JSON value a string (or key) holds a NUL character, or None."""
    return first_path(value, lambda v: isinstance(v, str) and "\x00" in v)


def nonfinite_path(value: Any) -> str | None:
    """Where in a decoded JSON value a number is NaN or infinite, or None (``json.loads``
    reads the ``NaN`` and ``Infinity`` that no JSON standard has, and ``1e999``, as such)."""
    return first_path(value, _non_finite)


def first_path(value: Any, bad: Callable[[Any], bool], path: str = "") -> str | None:
    """Where in a value of dicts and lists (tuples too) ``bad`` holds of a leaf or a dict
    key, dotted (``"lines.2.sku"``, ``"(value)"`` for ``value`` itself), or None."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return (path or "(value)") if bad(value) else None
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, dict) and bad(key):
            return where
        found = first_path(item, bad, where)
        if found is not None:
            return found
    return None


def _too_long_int(value: Any) -> bool:
    return isinstance(value, int) and abs(value) >= _INT_TOO_LONG


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


# Values JSON cannot give back, found in a payload that would not survive storage: what
# InvalidPayload says of each (and its error type).
UNSTORABLE: tuple[tuple[Callable[[Any], bool], str, str], ...] = (
    (
        _too_long_int,
        f"an int of more than {INT_MAX_DIGITS:,} digits cannot be read back from JSON, so "
        "the job could never run; store it elsewhere and pass a reference, or pass it as text",
        "int_too_long",
    ),
    (
        # float parameters refuse NaN themselves (allow_inf_nan=False); under Any, dict[str,
        # Any] or a model of its own a NaN was written as null and read back as None
        _non_finite,
        "a NaN or infinite float cannot be stored as JSON (it would be read back as null); "
        "pass None, or the value as text",
        "finite_number",
    ),
)


def unstorable_json(what: str, text: str) -> InvalidPayload | None:
    """Why JSON text (serialised by pydantic, from any value) cannot be stored, naming
    where in it and the fix, or None: see :func:`read_back`."""
    try:
        read_back(what, text)
    except InvalidPayload as problem:
        return problem
    return None


class _TooLong(int):
    """An int read back from JSON with more digits than readers take (see read_back)."""


def _read_int(digits: str) -> int:
    if len(digits) - digits.startswith("-") > INT_MAX_DIGITS:
        return _TooLong()
    return int(digits)


def read_back(what: str, text: str) -> Any:
    """The value JSON text (serialised by pydantic, from any value) reads back as, or
    InvalidPayload naming where in it the problem is and the fix, when it cannot be
    stored or read back: an int of more than 4,300 digits (pydantic writes it; Python's
    json, whatever this process's sys.set_int_max_str_digits, and pydantic's parser read
    no such int: a signal payload holding one was stored, and its job failed on every
    run and replay), a NaN or infinite number (SQLite kept it as JSON no standard reader
    takes, and PostgreSQL's jsonb refused it with a raw driver error) or an escaped NUL
    character (which jsonb cannot hold), as job arguments refuse them."""
    long_run = len(text) > INT_MAX_DIGITS and _LONG_DIGITS.search(text) is not None
    try:  # (the hook only when a run of digits that long is there: it costs a call per int)
        value = json.loads(text, parse_int=_read_int if long_run else None)
    except (ValueError, RecursionError) as exc:
        raise InvalidPayload(
            f"{what}: its JSON cannot be read back ({type(exc).__name__}: {exc}); pass "
            "JSON-friendly data (dicts, lists, strings, numbers), or store it elsewhere and "
            "pass a reference"
        ) from None
    if long_run and (where := first_path(value, _too_long_read)) is not None:
        raise InvalidPayload(
            f"{what}: {where}: an int of more than {INT_MAX_DIGITS:,} digits, which cannot "
            "be read back from JSON; store it elsewhere and pass a reference, or pass it as "
            "text (a str)"
        )
    nonfinite = "NaN" in text or "Infinity" in text  # bare tokens; rare inside strings too
    if nonfinite and (where := nonfinite_path(value)) is not None:
        raise InvalidPayload(
            f"{what}: {where}: a number that is NaN or infinite, which JSON cannot hold; "
            'use a finite number, null, or a string such as "inf"'
        )
    if holds_nul(text) and (where := nul_path(value)) is not None:
        raise InvalidPayload(
            f"{what}: {where}: contains the NUL character (\\x00), which PostgreSQL cannot "
            f"store; {NUL_FIX}"
        )
    return value


def _too_long_read(value: Any) -> bool:
    return isinstance(value, _TooLong)


def _nonfinite_result(job_name: str, value: Any) -> InvalidPayload | None:
    """Why a handler's result cannot be stored when it holds a NaN or an infinity, which
    its JSON (pydantic's, by default) wrote as null: the caller read back None, silently,
    where ctx.step results, signal payloads and arguments refuse them. None otherwise."""
    try:
        plain = to_jsonable_python(value)  # models and dataclasses as dicts, floats kept
    except (PydanticSerializationError, ValueError, TypeError):
        return None
    where = nonfinite_path(plain)
    if where is None:
        return None
    return InvalidPayload(
        f"{job_name}: the handler's result: {where}: a number that is NaN or infinite, "
        'which JSON cannot hold; return a finite number, None, or a string such as "inf"'
    )


def describe_validation_error(prefix: str, exc: ValidationError) -> InvalidPayload:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err.get("loc", ())) or "(arguments)"
        message = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            message = "unexpected argument (the handler has no parameter of that name)"
        parts.append(f"{where}: {message}")
    return InvalidPayload(
        f"{prefix}: " + "; ".join(parts),
        errors=[dict(e) for e in exc.errors(include_url=False, include_input=False)],
    )


# Types pydantic validates with its own code alone (no hook of the application's).
_BUILTIN_LEAVES = frozenset(
    {int, str, bool, float, bytes, type(None), Any, date, datetime, time, timedelta, UUID, Decimal}
)
_BUILTIN_CONTAINERS = frozenset({list, dict, tuple, set, frozenset, typing.Union, UnionType})


def _builtin_only(annotation: Any) -> bool:
    """Whether validating ``annotation`` runs only pydantic's own code: builtin scalars,
    dates, UUIDs and Decimals, and lists, dicts, tuples, sets and unions of them. Anything
    else (a model, a dataclass, an enum, a TypedDict, Annotated metadata, a type of the
    application's) may run the application's code, which may be slow or block."""
    origin = typing.get_origin(annotation)
    try:
        if origin is None:  # a leaf, or a bare list, dict, ...
            return annotation in _BUILTIN_LEAVES or annotation in _BUILTIN_CONTAINERS
        if origin not in _BUILTIN_CONTAINERS:
            return False  # Annotated, Literal (harmless, but rare), a generic of its own, ...
    except TypeError:  # unhashable (a type form of a library's own): not known to be builtin
        return False
    return all(arg is Ellipsis or _builtin_only(arg) for arg in typing.get_args(annotation))


def _plain_default(default: Any) -> bool:
    """Whether filling in a parameter's default runs none of the application's code: none
    (required), or an immutable builtin value (not a default_factory, not an object
    pydantic deep-copies)."""
    return default is ... or default is None or type(default) in (int, str, bool, float, bytes)


class PayloadSpec:
    """Validates, encodes and decodes one handler's arguments and result."""

    def __init__(
        self,
        fn: Callable[..., Any],
        job_name: str,
        *,
        context_type: type,
        max_bytes: int = MAX_PAYLOAD_BYTES_DEFAULT,
        max_result_bytes: int = MAX_RESULT_BYTES_DEFAULT,
    ) -> None:
        self.job_name = job_name
        self.max_bytes = max_bytes
        self.max_result_bytes = max_result_bytes
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except TypeError:  # not a function (a functools.partial): said by the definition
            raise
        except Exception as exc:  # an unresolvable forward reference, say
            raise ConfigurationError(
                f"job {job_name!r}: cannot resolve the type hints of {fn.__qualname__}: {exc}"
            ) from exc
        self.signature = inspect.signature(fn)
        self.context_param: str | None = None
        fields: dict[str, Any] = {}
        for name, param in self.signature.parameters.items():
            annotation = hints.get(name, Any)
            if annotation is context_type:
                self.context_param = name
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ConfigurationError(
                    f"job {job_name!r}: *{name} / **{name} cannot be stored as a durable payload; "
                    "declare each argument as a named parameter with a type hint"
                )
            if name in RESERVED_OPTIONS:
                raise ConfigurationError(
                    f"job {job_name!r}: parameter {name!r} clashes with the enqueue option of "
                    f"that name ({', '.join(sorted(RESERVED_OPTIONS))}); rename the parameter"
                )
            default = ... if param.default is param.empty else param.default
            fields[name] = (annotation, default)
        self.fields = tuple(fields)
        # Validated ints, bools and ASCII strings always come back from their JSON exactly:
        # for such payloads encode() can skip the round trip that guards the rest.
        self._plain = all(annotation in (int, str, bool) for annotation, _ in fields.values())
        # Decoding runs none of the application's code (no validator, no type of its own,
        # no Annotated metadata): an async worker may decode such a payload on its loop.
        self.decodes_without_user_code = all(
            _builtin_only(annotation) and _plain_default(default)
            for annotation, default in fields.values()
        )
        self._params = [p for p in self.signature.parameters if p != self.context_param]
        try:
            self.model: type[BaseModel] = create_model(  # type: ignore[call-overload]
                f"{job_name}_args",
                # a NaN or infinite float would be stored as null and fail at execution
                __config__=ConfigDict(extra="forbid", allow_inf_nan=False),
                **fields,
            )
            return_hint = hints.get("return", Any)
            self.result_adapter: TypeAdapter[Any] = TypeAdapter(
                Any if return_hint is type(None) else return_hint
            )
        except (PydanticSchemaGenerationError, PydanticUserError) as exc:
            raise ConfigurationError(
                f"job {job_name!r}: a parameter or return type cannot be stored as JSON: {exc}. "
                "Use JSON-friendly types (int, str, float, bool, lists, dicts, datetime, "
                "UUID, Decimal, enums, pydantic models, dataclasses, TypedDicts)"
            ) from exc
        except (NameError, ValueError) as exc:  # a name pydantic keeps for itself
            raise ConfigurationError(
                f"job {job_name!r}: a parameter name cannot be a payload field: {exc}; "
                "rename the parameter"
            ) from exc
        # pydantic silently drops some names (a leading '_', model_config); such a
        # parameter could never be passed, so refuse it here rather than at every enqueue.
        unusable = [name for name in self.fields if name not in self.model.model_fields]
        if unusable:
            raise ConfigurationError(
                f"job {job_name!r}: parameter(s) {', '.join(map(repr, unusable))} cannot be "
                "payload fields (a leading '_' or a name pydantic reserves); rename them"
            )
        self.stored_defaults = self._stored_defaults()

    def _stored_defaults(self) -> dict[str, Any]:
        """Each parameter as the stored JSON would hold it had the caller passed its
        default (None for a parameter without one). The payload leaves out a parameter left
        at its default (``exclude_unset``): a key template reads it from here, so that
        ``f(1)`` and ``f(1, account="main")`` build the same key."""
        unset = self.model.model_construct()  # the defaults alone, nothing validated
        serializer = self.model.__pydantic_serializer__
        values: dict[str, Any] = {}
        for name in self.fields:
            if name not in unset.__dict__:  # required: always in the payload
                values[name] = None
                continue
            try:
                values[name] = serializer.to_python(
                    unset, mode="json", include={name}, warnings=False
                )[name]
            except PydanticSerializationError:  # a default with no JSON form: as it is
                values[name] = unset.__dict__[name]
        return values

    def bind_arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Map positional and keyword arguments onto parameter names."""
        params = self._params  # parameter names in order, the Context's left out
        if len(args) > len(params):
            raise InvalidPayload(
                f"{self.job_name}: takes {len(params)} argument(s) ({', '.join(params)}), "
                f"got {len(args)} positional"
            )
        bound = dict(zip(params, args, strict=False))
        for name, value in kwargs.items():
            if name in bound:
                raise InvalidPayload(f"{self.job_name}: argument {name!r} given twice")
            bound[name] = value
        return bound

    def encode(self, arguments: Mapping[str, Any]) -> str:
        """Validate arguments and return their JSON; raise InvalidPayload naming the field."""
        if self.context_param and self.context_param in arguments:
            raise InvalidPayload(
                f"{self.job_name}: {self.context_param!r} is the job's Context, injected by the "
                "worker; do not pass it"
            )
        # The model's validator and serializer are called directly: what model_validate
        # and model_dump_json do, without their wrappers (a third of the enqueue's cost).
        try:
            model = self.model.__pydantic_validator__.validate_python(dict(arguments))
        except ValidationError as exc:
            raise describe_validation_error(f"{self.job_name}: invalid arguments", exc) from None
        try:
            # warnings=False: a value pydantic let through but cannot write as its type (an
            # Enum member in a list[int]) is refused by the round trip below instead
            text = self.model.__pydantic_serializer__.to_json(
                model, exclude_unset=True, warnings=False
            ).decode()
        except PydanticSerializationError as exc:
            where = next((f for f in self.fields if not _serialisable(model, f)), "(arguments)")
            raise InvalidPayload(
                f"{self.job_name}: arguments are not JSON-serialisable: {where}: {exc}"
            ) from None
        is_ascii = text.isascii()
        size = len(text) if is_ascii else len(text.encode("utf-8"))
        if size > self.max_bytes:
            raise InvalidPayload(
                f"{self.job_name}: payload is {size:,} bytes, over the limit of "
                f"{self.max_bytes:,}; store large data elsewhere (a file, a table, object "
                "storage) and pass a reference, or raise App(max_payload_bytes=...)"
            )
        if holds_nul(text):
            where = nul_path(json.loads(text)) or "(arguments)"
            raise InvalidPayload(
                f"{self.job_name}: invalid arguments: {where}: contains the NUL character "
                f"(\\x00), which PostgreSQL cannot store; {NUL_FIX}",
                errors=[{"loc": tuple(where.split(".")), "msg": "NUL character", "type": "nul"}],
            )
        if self._plain and is_ascii:
            if size > INT_MAX_DIGITS:  # only a payload this long can hold such an int
                self._refuse_unstorable(model)
            return text
        try:  # what is stored must validate again at execution (nested NaN, say, would not)
            back = self.model.model_validate_json(text)
        except ValidationError as exc:
            self._refuse_unstorable(model)
            raise describe_validation_error(
                f"{self.job_name}: arguments would not survive storage as JSON", exc
            ) from None
        if back != model:  # rare: a value JSON cannot carry exactly (or a tuple -> list)
            self._refuse_unstorable(model)
            text = self._exact_instants(model, text)
        return text

    def _refuse_unstorable(self, model: BaseModel) -> None:
        """InvalidPayload naming the field of a value JSON cannot give back (UNSTORABLE)."""
        values = model.model_dump()
        for unstorable, problem, kind in UNSTORABLE:
            where = first_path(values, unstorable)
            if where is not None:
                raise InvalidPayload(
                    f"{self.job_name}: invalid arguments: {where}: {problem}",
                    errors=[{"loc": tuple(where.split(".")), "msg": problem, "type": kind}],
                )

    def _exact_instants(self, model: BaseModel, text: str) -> str:
        """Datetimes (and times) whose UTC offset has seconds (historical zones:
        Europe/Amsterdam before 1937 was +00:19:32) would lose those seconds in JSON,
        which holds offsets to the minute; store them in UTC instead, the same instant."""
        changed: list[bool] = []
        fixed = _utc_where_offset_has_seconds(model.model_dump(), changed)
        if not changed:
            return text
        return self.model.model_validate(fixed).model_dump_json(exclude_unset=True, warnings=False)

    def decode(self, args_json: str) -> dict[str, Any]:
        """Validate stored JSON again at execution; raise InvalidPayload when it no longer fits."""
        try:
            model = self.model.__pydantic_validator__.validate_json(args_json)
        except ValidationError as exc:
            raise describe_validation_error(
                f"{self.job_name}: stored payload fails validation", exc
            ) from None
        return {name: getattr(model, name) for name in self.fields}

    def encode_result(self, value: Any) -> str | None:
        if value is None:
            return None
        try:
            text = self.result_adapter.dump_json(value, warnings=False).decode("utf-8")
        except (PydanticSerializationError, ValueError, TypeError) as exc:
            raise InvalidPayload(
                f"{self.job_name}: the handler returned a {type(value).__name__}, which cannot be "
                f"stored as JSON ({exc}); return JSON-friendly data or None"
            ) from None
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
        if size > self.max_result_bytes:
            raise InvalidPayload(
                f"{self.job_name}: the handler's result is {size:,} bytes of JSON, over the "
                f"limit of {self.max_result_bytes:,} (App(max_result_bytes=...)); store large "
                "results elsewhere (a file, a table, object storage) and return a reference, "
                "or raise the limit"
            )
        if holds_nul(text):
            raise InvalidPayload(
                f"{self.job_name}: the handler's result holds the NUL character (\\x00) at "
                f"{nul_path(json.loads(text))}, which PostgreSQL cannot store; {NUL_FIX}"
            )
        if len(text) > INT_MAX_DIGITS and _LONG_DIGITS.search(text) is not None:
            # an int no JSON reader takes back: completed, its result read back as text
            read_back(f"{self.job_name}: the handler's result", text)
        if "null" in text:  # pydantic writes a NaN or an infinity as null: look again
            nonfinite = _nonfinite_result(self.job_name, value)
            if nonfinite is not None:
                raise nonfinite
        return text

    def decode_result(self, value: Any) -> Any:
        if value is None:
            return None
        try:
            return self.result_adapter.validate_python(value)
        except ValidationError:
            return value


def _utc_where_offset_has_seconds(value: Any, changed: list[bool]) -> Any:
    """``value`` with such datetimes moved to UTC (same instant); ``changed`` gets an
    entry for each one moved."""
    if isinstance(value, datetime | time):
        offset = value.utcoffset()
        if offset is None or not (offset.seconds % 60 or offset.microseconds):
            return value
        changed.append(True)
        if isinstance(value, datetime):
            return value.astimezone(UTC)
        moved = datetime.combine(date(2000, 1, 3), value.replace(tzinfo=None)) - offset
        return moved.time().replace(tzinfo=UTC)
    if isinstance(value, dict):
        return {k: _utc_where_offset_has_seconds(v, changed) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_utc_where_offset_has_seconds(v, changed) for v in value)
    return value


def _serialisable(model: BaseModel, field: str) -> bool:
    try:
        model.model_dump_json(include={field}, warnings=False)
    except PydanticSerializationError:
        return False
    return True


def mask(arguments: Mapping[str, Any], sensitive: Iterable[str]) -> dict[str, Any]:
    """A copy of ``arguments`` with every sensitive field's value replaced by ``***``."""
    hidden = set(sensitive)
    if not hidden:
        return dict(arguments)
    return {k: (MASK if k in hidden else v) for k, v in arguments.items()}
