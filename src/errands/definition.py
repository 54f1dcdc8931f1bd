"""``@app.job``: a job definition, its options, and enqueue from it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import operator
import os
import re
import string
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from .backends.limits import LIMIT_MAX, parse_rate
from .context import Context
from .errors import ConfigurationError, InvalidPayload
from .jobs import DUE_MIN, ID_MAX, EnqueueRequest
from .jsontext import loads_stored
from .payload import PayloadSpec
from .retry import BackoffPolicy, as_backoff

if TYPE_CHECKING:
    from .app import App
    from .handle import JobHandle

P = ParamSpec("P")
R = TypeVar("R")

RETRIES_DEFAULT = 3
NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:\-]{0,199}$")
# PostgreSQL indexes (name, key): a btree entry holds at most ~2,700 bytes.
KEY_MAX_BYTES = 1000


# The longest duration an option takes (delay, timeout, lease, unique_for, retention, ...):
# a delay of 5,000,000 days or infinity was stored, and every read of the job (get_job,
# listings, the dashboard, handle.status()) then failed to make its due date a datetime.
DURATION_MAX = 100 * 365.25 * 86400


PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # PostgreSQL's integer, on every store
# When a job may be due (epoch seconds): years 1 to 9998 in UTC, so that every time zone
# reads it back as a date (9999-12-31T23:59-12:00 is year 10000 in UTC: every listing of
# the store then failed, "year 10000 is out of range").
RUN_AT_MIN, RUN_AT_MAX = DUE_MIN, 253_370_764_800.0


def checked_epoch(value: float, what: str) -> float:
    """``value`` (epoch seconds of a run_at) when a date can be made of it again."""
    if not RUN_AT_MIN <= value <= RUN_AT_MAX:
        raise ConfigurationError(
            f"{what}: {value:.0f} s since 1970 is out of range; give a date between the "
            "years 1 and 9998"
        )
    return value


def checked_priority(value: Any, what: str) -> int:
    """``value`` when it is an int within PostgreSQL's integer (every store keeps the
    same range: 2**40 was stored on SQLite and failed deep inside on PostgreSQL)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{what} must be an int (higher runs first), got {value!r}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ConfigurationError(
            f"{what} must be between {PRIORITY_MIN:,} and {PRIORITY_MAX:,}, got {shown(value)}"
        )
    return value


ID_RANGE = f"1<=x<={ID_MAX}"  # as click's IntRange says it on the command line


def checked_count(value: object, what: str, fix: str) -> int:
    """``value`` as a plain int from 1 to ``ID_MAX``: a job's or a workflow's id, a
    listing's limit. Any other value is refused here, saying what was given and what is
    expected, never passed on to the store (a larger int was an OverflowError on SQLite and
    "bigint out of range" on PostgreSQL; "5" acted on job 5, None or 1.5 was "no such
    job"; a negative limit was PostgreSQL's InvalidRowCountInLimitClause). ``fix``: how
    to pass one."""
    number: int | None = None
    if not isinstance(value, bool):  # True is an int to Python, never an id
        with contextlib.suppress(TypeError):
            number = operator.index(value)  # type: ignore[arg-type]  # an int, numpy.int64
    if number is None or not 1 <= number <= ID_MAX:
        given = shown(value) if isinstance(value, int) else repr(value)
        if len(given) > 80:
            given = given[:77] + "..."
        kind = "" if number is not None or value is None else f", a {type(value).__name__}"
        raise ConfigurationError(
            f"{what} must be an int in the range {ID_RANGE} (1 to 2**63-1), got "
            f"{given}{kind}: {fix}"
        )
    return int(number)


def checked_id(value: object, what: str = "job id") -> int:
    """A job's (or a workflow's) id as an int from 1 to 2**63-1; ConfigurationError else."""
    where = "app.workflows()" if what.startswith("workflow") else "app.jobs()"
    return checked_count(value, what, f"pass a stored id as an int, as {where} lists them")


def checked_ids(values: object, verb: str) -> list[int]:
    """``ids=`` of an admin action: an iterable of job ids, each :func:`checked_id`. A
    string is refused (replay("12") acted on jobs 1 and 2), as is one bare id."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ConfigurationError(
            f"{verb}: ids must be a list of job ids, got {shown(values)[:80]}: pass a list, "
            f"as in {verb}([42]) for one job"
        )
    return [checked_id(v, f"{verb}: job id") for v in values]


def checked_limit(value: object, what: str = "limit") -> int:
    """How many rows a listing returns at most: an int from 1 to 2**63-1."""
    return checked_count(value, what, f"pass how many rows to return at most, as in {what}=100")


def seconds(value: float | timedelta | None, option: str, owner: str = "") -> float | None:
    """A duration option as seconds: a number or a ``timedelta``, never text (``"30s"``).

    ``owner`` prefixes the error (``"job 'shop.charge': "``)."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            result = float(value)
        except OverflowError:  # an int past every float (10**400): past the bounds too
            result = math.inf if value > 0 else -math.inf
    else:
        raise ConfigurationError(
            f"{owner}{option}={value!r}: give a number of seconds or a datetime.timedelta, "
            f"as in {option}=30 or {option}=timedelta(seconds=30)"
        )
    if result < 0 or result != result:  # NaN compares unequal to itself
        raise ConfigurationError(f"{owner}{option}={shown(value)}: must be >= 0")
    if result > DURATION_MAX:  # infinity too
        raise ConfigurationError(
            f"{owner}{option}={shown(value)}: must be at most 100 years "
            f"({DURATION_MAX:,.0f} s); a job due further away cannot be read back as a date"
        )
    return result


def shown(value: object) -> str:
    """``repr(value)`` for an error message, a long int summarised by its length (Python
    will not write one of more than 4,300 digits, and 10**400 would fill the message)."""
    if isinstance(value, int) and abs(value) >= 10**30:
        digits = int((abs(value).bit_length() - 1) * math.log10(2)) + 1
        digits += abs(value) >= 10**digits  # the estimate is that or one short
        return f"<{'a negative' if value < 0 else 'an'} int of {digits:,} digits>"
    return repr(value)


def exception_classes(value: Any, option: str, owner: str = "") -> tuple[type[BaseException], ...]:
    """``permanent=``: a tuple (or any iterable) of exception classes, never one bare class."""
    example = f"{option}=(ValueError,)"
    if isinstance(value, type | str | bytes):
        named = value.__name__ if isinstance(value, type) else repr(value)
        raise ConfigurationError(
            f"{owner}{option}={named}: give a tuple of exception classes, as in "
            f"{option}=({named},)" + ("" if isinstance(value, type) else f" or {example}")
        )
    try:
        classes = tuple(value)
    except TypeError:
        raise ConfigurationError(
            f"{owner}{option}={value!r}: give a tuple of exception classes, as in {example}"
        ) from None
    for exc_type in classes:
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            raise ConfigurationError(
                f"{owner}{option}= takes exception classes, got {exc_type!r}; write {example}"
            )
    return classes


def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not NAME_PATTERN.match(value):
        what = "" if isinstance(value, str) else f" is a {type(value).__name__}, not a string"
        raise ConfigurationError(
            f"{kind} name {value!r}{what}: use 1-200 letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or '_'"
        )
    return value


def check_text(what: str, value: str, max_bytes: int | None = None) -> str:
    """A string errands stores or compares in SQL: no NUL character (PostgreSQL text cannot
    hold one), valid Unicode (no lone surrogate, as an undecodable command-line byte
    becomes), and at most ``max_bytes`` of UTF-8."""
    if not isinstance(value, str):
        raise ConfigurationError(
            f"{what} must be a string, got {type(value).__name__}: pass it as text (a str)"
        )
    if "\x00" in value:
        raise ConfigurationError(
            f"{what} contains the NUL character (\\x00), which PostgreSQL cannot store; remove it"
        )
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigurationError(
            f"{what} {value!r} is not valid Unicode (a lone surrogate, such as an undecodable "
            "byte on the command line); pass UTF-8 text"
        ) from None
    if max_bytes is not None and size > max_bytes:
        raise ConfigurationError(
            f"{what} is {size:,} bytes of UTF-8, over the limit of {max_bytes:,}; pass a "
            "shorter value (a hash of a long one, such as hashlib.sha256(...).hexdigest())"
        )
    return value


MAIN_MODULE_WARNING = (
    "job {name!r} is defined in the script Python runs as __main__, so it is named after "
    "__main__, which no worker can import: a worker would never run it (UnknownJob). "
    "Define your jobs in a module and import them (from shop import ...), or give the job "
    "a name= of its own"
)
_PACKAGE_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


def _user_level() -> int:
    """The ``stacklevel`` of the first frame outside errands: a warning points at the
    user's line, however deep in errands it is raised."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_FOLDER):
        frame, level = frame.f_back, level + 1
    return level


@dataclass(frozen=True)
class EnqueueOptions:
    key: str | None = None
    delay: float | timedelta | None = None
    run_at: datetime | None = None
    priority: int | None = None
    queue: str | None = None
    unique_for: float | timedelta | None = None


NO_OPTIONS = EnqueueOptions()


def _options(
    key: str | None,
    delay: float | timedelta | None,
    run_at: datetime | None,
    priority: int | None,
    queue: str | None,
    unique_for: float | timedelta | None,
) -> EnqueueOptions:
    """An enqueue's options: NO_OPTIONS when none is given (the common case, without an
    object built per job, and request() skips their checks)."""
    if (
        key is None
        and delay is None
        and run_at is None
        and priority is None
        and queue is None
        and unique_for is None
    ):
        return NO_OPTIONS
    return EnqueueOptions(key, delay, run_at, priority, queue, unique_for)


class JobDefinition(Generic[P, R]):
    """What ``@app.job`` returns: still callable as the plain function, plus ``enqueue``."""

    def __init__(
        self,
        app: App,
        fn: Callable[P, R],
        *,
        name: str | None,
        queue: str | None,
        priority: int,
        retries: int,
        backoff: BackoffPolicy | Callable[[int], float] | float | None,
        timeout: float | timedelta | None,
        lease: float | timedelta | None,
        permanent: Iterable[type[BaseException]],
        sensitive: Iterable[str],
        unique_for: float | timedelta | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
        rate: str | None = None,
        fair_key: str | None = None,
    ) -> None:
        if not callable(fn) or (name is None and not hasattr(fn, "__qualname__")):
            raise _not_a_function(fn)
        self.app = app
        self.fn: Callable[P, R] = fn
        self.name = check_name("job", name or f"{fn.__module__}.{fn.__qualname__}")
        # Defined in a script run as `python shop.py`: named __main__.<function>, which no
        # worker can import. Said once, at the first enqueue.
        self._warn_main = name is None and fn.__module__ == "__main__"
        # Only None means the default: queue="" (or 0) took it silently.
        self.queue = check_name("queue", app.default_queue if queue is None else queue)
        self.priority = checked_priority(priority, f"job {self.name!r}: priority")
        if not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(f"job {self.name!r}: retries={retries!r} must be an int >= 0")
        self.retries = retries
        self.max_attempts = retries + 1
        self.backoff = as_backoff(backoff)
        owner = f"job {self.name!r}: "
        self.timeout = seconds(timeout, "timeout", owner)
        self.lease = seconds(lease, "lease", owner)
        self.unique_for = seconds(unique_for, "unique_for", owner)
        if self.lease is not None and self.lease < 1:
            raise ConfigurationError(f"job {self.name!r}: lease must be at least 1 second")
        self.permanent = exception_classes(permanent, "permanent", owner)
        self.is_async = asyncio.iscoroutinefunction(fn)
        try:
            self.payload = PayloadSpec(
                fn, self.name, context_type=Context, max_bytes=app.max_payload_bytes,
                max_result_bytes=app.max_result_bytes,
            )  # fmt: skip
        except TypeError as exc:  # its signature or type hints cannot be read (a partial)
            raise _not_a_function(fn) from exc
        self.sensitive = frozenset(sensitive)
        unknown = self.sensitive - set(self.payload.fields)
        if unknown:
            raise ConfigurationError(
                f"job {self.name!r}: sensitive= names {sorted(unknown)}, which are not "
                f"parameters; parameters are {list(self.payload.fields)}"
            )
        self.concurrency_key, self.concurrency_limit = self._check_key(
            concurrency_key, concurrency_limit
        )
        self.rate = parse_rate(rate) if rate is not None else None
        self.fair_key = None if fair_key is None else self._check_template("fair_key", fair_key)
        self.logger = logging.getLogger(f"errands.job.{self.name}")  # ctx.logger
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def _check_key(self, template: str | None, limit: int | None) -> tuple[str | None, int | None]:
        if template is None:
            if limit is not None:
                raise ConfigurationError(
                    f"job {self.name!r}: concurrency_limit= needs a concurrency_key= template, "
                    "as in concurrency_key='account:{account_id}'"
                )
            return None, None
        self._check_template("concurrency_key", template)
        limit = 1 if limit is None else limit
        # Stored on each row, in PostgreSQL's integer: 2**40 passed here and then every
        # enqueue failed (NumericValueOutOfRange; SQLite's 2**63: OverflowError); True ran
        # as 1. As app.queue(limit=) is checked.
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= LIMIT_MAX:
            raise ConfigurationError(
                f"job {self.name!r}: concurrency_limit={shown(limit)}: give an int from 1 to "
                f"{LIMIT_MAX:,}: how many jobs of one key may run at once across the cluster, "
                "as in concurrency_limit=1 (the default)"
            )
        return template, limit

    def _check_template(self, option: str, template: object) -> str:
        """A key template (``"account:{account_id}"``) over this job's parameters."""
        if not isinstance(template, str):
            raise ConfigurationError(
                f"job {self.name!r}: {option}= must be a str template, as in "
                f"{option}='tenant:{{tenant_id}}'"
            )
        formatter = string.Formatter()
        try:
            parsed = [p for p in formatter.parse(template) if p[1] is not None]
            # a field in a format spec ("{name:>{width}}") is filled from the arguments too
            nested = [p for _, _, spec, _ in parsed if spec for p in formatter.parse(spec)]
        except ValueError as exc:
            raise ConfigurationError(
                f"job {self.name!r}: {option}={template!r} is not a valid template: {exc}"
            ) from None
        parsed += [p for p in nested if p[1] is not None]
        if any(not field for _, field, _, _ in parsed):
            raise ConfigurationError(
                f"job {self.name!r}: {option}={template!r} has a field without a name ('{{}}'): "
                f"name the parameter, as in {option}='tenant:{{tenant_id}}'"
            )
        fields = {field for _, field, _, _ in parsed if field}
        named = {f.split(".")[0].split("[")[0] for f in fields}
        unknown = named - set(self.payload.fields)
        if unknown:
            raise ConfigurationError(
                f"job {self.name!r}: {option}={template!r} names {sorted(unknown)}, which "
                f"are not parameters; parameters are {list(self.payload.fields)}"
            )
        for _, field, spec, conversion in parsed:  # each enqueue failed on these
            self._check_field_format(option, template, field or "", spec or "", conversion)
        secret = named & self.sensitive
        if secret:  # a key is stored and shown as it is (tenants page, metrics' key label)
            raise ConfigurationError(
                f"job {self.name!r}: {option}={template!r} is built from {sorted(secret)}, "
                "which sensitive= masks everywhere else; a key is shown as it is (the "
                "dashboard, metrics labels): build it from a parameter that is not "
                "sensitive (an id)"
            )
        return template

    def _check_field_format(
        self, option: str, template: str, field: str, spec: str, conversion: str | None
    ) -> None:
        """A template field's conversion (``!r``, ``!s``, ``!a``) and format spec: a spec
        that no value of the parameter's type can take (``{account_id:zz}`` of an int)
        failed every enqueue; refused here. A spec with fields of its own is filled at
        enqueue, and checked there."""
        if conversion is not None and conversion not in ("r", "s", "a"):
            raise ConfigurationError(
                f"job {self.name!r}: {option}={template!r}: '!{conversion}' is no conversion; "
                "use !s, !r or !a, or none"
            )
        if not spec or "{" in spec:
            return
        if conversion is not None:
            samples: tuple[object, ...] = ("x",)  # converted: a str
        else:
            model_field = self.payload.model.model_fields.get(field)
            hint = (
                model_field.annotation if model_field is not None and field.isidentifier() else None
            )
            samples = _FORMAT_SAMPLES.get(hint, (0, 0.0, "x"))  # type: ignore[arg-type]
        for sample in samples:
            try:
                format(sample, spec)
                return
            except (ValueError, TypeError):
                continue
        kinds = " or ".join(sorted({type(s).__name__ for s in samples}))
        raise ConfigurationError(
            f"job {self.name!r}: {option}={template!r}: the format spec ':{spec}' of field "
            f"{field!r} fits no {kinds} value; use a spec of Python's format mini-language "
            "(as in '{account_id:08d}') or none"
        )

    @property
    def limited(self) -> bool:
        return self.concurrency_key is not None or self.rate is not None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the handler directly, in this process, with no job involved."""
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<job {self.name} queue={self.queue}>"

    # -- enqueue -------------------------------------------------------------------------
    def bind(
        self,
        *args: Any,
        key: str | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        priority: int | None = None,
        queue: str | None = None,
        unique_for: float | timedelta | None = None,
        **kwargs: Any,
    ) -> BoundJob:
        """Validate arguments now and return a job ready for ``app.enqueue_many``."""
        options = _options(key, delay, run_at, priority, queue, unique_for)
        return BoundJob(self, self.request(args, kwargs, options))

    def enqueue(
        self,
        *args: Any,
        key: str | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        priority: int | None = None,
        queue: str | None = None,
        unique_for: float | timedelta | None = None,
        conn: Any = None,
        **kwargs: Any,
    ) -> JobHandle:
        """Validate and store one job; with ``conn=`` inside the caller's transaction.

        ``key`` makes the job unique per job name while its row exists (or, with
        ``unique_for``, for that long): enqueueing the key again returns the existing job
        with ``handle.deduplicated`` set.
        """
        # what bind() does, without handing every option on through a second call
        options = _options(key, delay, run_at, priority, queue, unique_for)
        bound = BoundJob(self, self.request(args, kwargs, options))
        return self.app.enqueue_many([bound], conn=conn)[0]

    async def aenqueue(
        self,
        *args: Any,
        key: str | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        priority: int | None = None,
        queue: str | None = None,
        unique_for: float | timedelta | None = None,
        conn: Any = None,
        **kwargs: Any,
    ) -> JobHandle:
        """:meth:`enqueue` for async code, with the same checks and errors; ``conn`` is the
        caller's async connection (see ``App.aenqueue_many``).

        .. versionadded:: 0.2
        """
        options = _options(key, delay, run_at, priority, queue, unique_for)
        bound = BoundJob(self, self.request(args, kwargs, options))
        return (await self.app.aenqueue_many([bound], conn=conn))[0]

    def request(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], options: EnqueueOptions
    ) -> EnqueueRequest:
        if self._warn_main:
            self._warn_main = False
            warnings.warn(MAIN_MODULE_WARNING.format(name=self.name), stacklevel=_user_level())
        args_json = self.payload.encode(self.payload.bind_arguments(args, kwargs))
        if options is NO_OPTIONS and self.unique_for is None:
            # The common case (a bulk enqueue's every job): no option to check, every
            # value the definition's or the arguments'. Positional, in field order.
            rate = self.rate
            return EnqueueRequest(
                self.name,
                self.queue,
                args_json,
                self.priority,
                self.max_attempts,
                0.0,
                None,
                None,
                self.timeout,
                self.lease,
                {"sensitive": sorted(self.sensitive)} if self.sensitive else {},
                None,
                None,
                None
                if self.concurrency_key is None
                else self._format_key("concurrency_key", self.concurrency_key, args_json),
                self.concurrency_limit,
                None if rate is None else rate[0],
                None if rate is None else rate[1],
                self._fair_key_for(self.queue, args_json),
            )
        return self._request(args_json, options)

    def _request(self, args_json: str, options: EnqueueOptions) -> EnqueueRequest:
        """The request of a job enqueued with options (``key=``, ``delay=``, ...)."""
        if options.key is not None and (not isinstance(options.key, str) or not options.key):
            raise ConfigurationError(f"{self.name}: key= must be a non-empty string")
        if options.key is not None:
            check_text(f"{self.name}: key=", options.key, KEY_MAX_BYTES)
        if options.delay is not None and options.run_at is not None:
            raise ConfigurationError(f"{self.name}: pass delay= or run_at=, not both")
        run_at: float | None = None
        if options.run_at is not None:
            if not isinstance(options.run_at, datetime):
                raise ConfigurationError(f"{self.name}: run_at= must be a datetime")
            if options.run_at.tzinfo is None:
                raise ConfigurationError(
                    f"{self.name}: run_at={options.run_at!r} has no time zone; pass an aware "
                    "datetime such as datetime.now(UTC) + timedelta(minutes=5)"
                )
            run_at = checked_epoch(options.run_at.timestamp(), f"{self.name}: run_at")
        priority = self.priority
        if options.priority is not None:
            priority = checked_priority(options.priority, f"{self.name}: priority")
        queue = self.queue if options.queue is None else check_name("queue", options.queue)
        return EnqueueRequest(
            name=self.name,
            queue=queue,
            args_json=args_json,
            priority=priority,
            max_attempts=self.max_attempts,
            delay=seconds(options.delay, "delay", f"{self.name}: ") or 0.0,
            run_at=run_at,
            key=options.key,
            timeout=self.timeout,
            lease_seconds=self.lease,
            meta={"sensitive": sorted(self.sensitive)} if self.sensitive else {},
            unique_for=self._unique_for(options),
            concurrency_key=self._format_key("concurrency_key", self.concurrency_key, args_json),
            fair_key=self._fair_key_for(queue, args_json),
            concurrency_limit=self.concurrency_limit,
            rate_limit=self.rate[0] if self.rate else None,
            rate_period=self.rate[1] if self.rate else None,
        )

    def _fair_key_for(self, queue: str, args_json: str) -> str | None:
        """The job's fair key: its template's, or in a queue this app declares fair,
        ``job:<name>`` (each job type without a template is its own key there)."""
        if self.fair_key is not None:
            # An empty key ("{tenant}" of tenant="") is no key: the claim tells the
            # unkeyed jobs apart by an empty name, which a real "" key broke (the
            # unkeyed rows left out of the lookahead, its own head read twice).
            return self._format_key("fair_key", self.fair_key, args_json) or None
        declared = self.app.queues.get(queue)
        return f"job:{self.name}" if declared is not None and declared.fair else None

    def _format_key(self, option: str, template: str | None, args_json: str) -> str | None:
        if template is None:
            return None
        return self.build_key(option, template, self._template_values(args_json))

    def _template_values(self, args_json: str) -> dict[str, Any]:
        """What a key template reads of a stored payload: each parameter by name."""
        # A parameter left at its default is not in the stored JSON: the template reads
        # its default (it read None, so f(1) and f(1, account="main") had two keys).
        values = dict(self.payload.stored_defaults)
        # (a row stored with an int of more than 4,300 digits: read whole, not a raw
        # ValueError out of an edit that moved every job it named, or none)
        values.update(loads_stored(args_json))
        return values

    def build_key(self, option: str, template: str, values: Mapping[str, Any]) -> str:
        """``template`` filled from ``values``, checked as every stored key is (no NUL, at
        most KEY_MAX_BYTES: PostgreSQL indexes it); InvalidPayload naming ``option``."""
        try:
            # Not prefixed with the job name: job types sharing a key share its limit.
            key = template.format(**values)
            return check_text(f"{self.name}: {option}", key, KEY_MAX_BYTES)
        except Exception as exc:  # "{tenant[q]}" of a str: TypeError, raw, at every enqueue
            said = (KeyError, IndexError, AttributeError, ValueError, ConfigurationError)
            detail = exc if isinstance(exc, said) else f"{type(exc).__name__}: {exc}"
            raise InvalidPayload(
                f"{self.name}: cannot build {option} {template!r} from the arguments: {detail}"
            ) from None

    def _unique_for(self, options: EnqueueOptions) -> float | None:
        value = seconds(options.unique_for, "unique_for")
        if value is None:
            value = self.unique_for
        if value is not None and options.key is None:
            fn = getattr(self.fn, "__name__", "job")
            raise ConfigurationError(
                f"{self.name}: unique_for= applies to a key, and this enqueue has none: pass "
                f'key= at each enqueue of the job, as in {fn}.enqueue(..., key=f"order:'
                f'{{order_id}}") ({fn}.bind(..., key=...) and ctx.enqueue({fn}, ..., key=...) '
                "take it too); @app.job takes no key template"
            )
        return value


# What a key template's field holds, by the parameter's type hint (the stored JSON's
# value): a format spec must fit it. Another hint: any of them will do.
_FORMAT_SAMPLES: dict[object, tuple[object, ...]] = {
    int: (0,),
    float: (0.0,),
    str: ("x",),
    bool: (False,),
}


def _not_a_function(fn: object) -> ConfigurationError:
    """What is said of a callable whose name, parameters or type hints cannot be read (a
    functools.partial failed from inside typing)."""
    return ConfigurationError(
        f"a job is a function (def or async def); the name, parameters or type hints of "
        f"{fn!r} cannot be read: define a function that calls it, with the parameters the "
        "job takes"
    )


@dataclass(frozen=True)
class BoundJob:
    """A validated job not yet stored: pass a list of them to ``app.enqueue_many``."""

    definition: JobDefinition[Any, Any]
    request: EnqueueRequest
