"""Fair-queue options: ``@app.job(fair_key=...)``, ``app.queue(fair=, aging=)`` and
``app.fair_weight``, checked at declaration with errors that name the fix."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import errands
from errands import ConfigurationError
from errands.errors import InvalidPayload


def _handler(tenant_id: int, n: int = 0) -> None: ...


def _define(app: errands.App, **options: Any) -> errands.JobDefinition[Any, Any]:
    options.setdefault("name", "t.job")
    return app.job(**options)(_handler)  # type: ignore[no-any-return]


def test_a_fair_key_template_naming_an_unknown_parameter_is_refused(app: errands.App) -> None:
    with pytest.raises(ConfigurationError, match=r"fair_key='t:\{tenant\}' names \['tenant'\]"):
        _define(app, fair_key="t:{tenant}")


def test_a_fair_key_that_is_not_a_template_is_refused(app: errands.App) -> None:
    with pytest.raises(ConfigurationError, match="not a valid template"):
        _define(app, fair_key="t:{tenant_id")
    with pytest.raises(ConfigurationError, match="must be a str template"):
        _define(app, fair_key=5)


def test_the_fair_key_is_built_from_the_arguments_at_enqueue(app: errands.App) -> None:
    job = _define(app, fair_key="tenant:{tenant_id}")
    assert job.bind(tenant_id=7).request.fair_key == "tenant:7"
    padded = _define(app, name="t.padded", fair_key="tenant:{tenant_id:02000d}")
    with pytest.raises(InvalidPayload, match="cannot build fair_key"):
        padded.bind(tenant_id=1)  # a key of at most 1000 bytes


def test_job_types_without_a_template_are_their_own_key_in_a_queue_declared_fair(
    app: errands.App,
) -> None:
    app.queue("reports", fair=True)
    plain = _define(app, name="t.plain", queue="reports")
    elsewhere = _define(app, name="t.elsewhere")
    assert plain.bind(tenant_id=1).request.fair_key == "job:t.plain"
    assert elsewhere.bind(tenant_id=1).request.fair_key is None


def test_aging_needs_a_fair_queue_and_at_least_one_second(app: errands.App) -> None:
    with pytest.raises(ConfigurationError, match="aging applies to fair queues; pass fair=True"):
        app.queue("q", aging=30)
    with pytest.raises(ConfigurationError, match="at least 1 second"):
        app.queue("q", fair=True, aging=0.5)
    with pytest.raises(ConfigurationError, match="fair must be a bool"):
        app.queue("q", fair="yes")  # type: ignore[arg-type]
    app.queue("q", fair=True, aging=timedelta(minutes=1))
    assert (app.queues["q"].fair, app.queues["q"].aging) == (True, 60.0)


def test_fair_weights_are_stored_audited_and_checked(app: errands.App) -> None:
    app.fair_weight("tenant:acme", 5, actor="ops:alice")
    assert [(w.key, w.weight, w.updated_by) for w in app.backend.fair_weights()] == [
        ("tenant:acme", 5.0, "ops:alice")
    ]
    event = app.audit(limit=1)[0]
    assert (event.action, event.actor, event.detail) == (
        "fair_weight",
        "ops:alice",
        {"key": "tenant:acme", "weight": 5.0},
    )
    app.fair_weight("tenant:acme", None)
    assert app.backend.fair_weights() == []
    with pytest.raises(ConfigurationError, match="weight must be a number above 0"):
        app.fair_weight("tenant:acme", 0)
