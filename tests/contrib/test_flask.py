"""errands.contrib.flask: the extension, current_jobs() and `flask errands-worker`."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("flask")

from flask import Flask

import errands
from errands.contrib.flask import Errands, current_jobs


def test_current_jobs_is_the_app_of_the_flask_application(db_url: str) -> None:
    app = errands.App(db_url)
    web = Flask(__name__)
    Errands(web, app)
    with web.app_context():
        assert current_jobs() is app


def test_current_jobs_without_the_extension_explains() -> None:
    web = Flask(__name__)
    with web.app_context(), pytest.raises(errands.ConfigurationError, match="Errands"):
        current_jobs()


def test_init_app_later(db_url: str) -> None:
    app = errands.App(db_url)
    extension = Errands(app=app)
    web = Flask(__name__)
    extension.init_app(web)
    assert web.extensions["errands"] is app
    with pytest.raises(errands.ConfigurationError):
        Errands().init_app(Flask(__name__))


def test_the_worker_command_is_registered(db_url: str) -> None:
    web = Flask(__name__)
    Errands(web, errands.App(db_url))
    result = web.test_cli_runner().invoke(args=["errands-worker", "--help"])
    assert result.exit_code == 0, result.output
    assert "--queues" in result.output


def test_the_worker_command_names_a_bad_queue_in_one_line_not_a_traceback(db_url: str) -> None:
    """`flask errands-worker -q "bad name!"` printed click's whole traceback; the errands
    CLI and the Django command print one error line."""
    web = Flask(__name__)
    Errands(web, errands.App(db_url))
    result = web.test_cli_runner().invoke(args=["errands-worker", "-q", "emails,bad name!"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "queue name 'bad name!'" in result.output
    assert "Traceback" not in result.output and result.exception.__class__ is SystemExit


@pytest.mark.parametrize(
    "args",
    [
        ["--grace", "nan"],
        ["--grace", "inf"],
        ["--poll-interval", "nan"],
        ["--poll-interval", "inf"],
    ],
)
def test_the_worker_command_refuses_nan_or_infinite_seconds_as_a_usage_error(
    db_url: str, args: list[str]
) -> None:
    """click's FloatRange lets NaN through (it compares false with either bound), and
    infinity past a minimum: ``flask errands-worker --poll-interval nan`` started a
    worker that never slept between claims. It is a usage error naming the option, as
    in ``errands worker``."""
    web = Flask(__name__)
    Errands(web, errands.App(db_url))
    result = web.test_cli_runner().invoke(args=["errands-worker", *args])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{args[0]}': '{args[1]}' is not a finite number" in result.output


def test_an_embedded_worker_runs_jobs(db_url: str) -> None:
    app = errands.App(db_url)

    @app.job(name="double")
    def double(x: int) -> int:
        return 2 * x

    handle = double.enqueue(x=21)
    extension = Errands(Flask(__name__), app, embedded_worker=True, poll_interval=0.05, grace=2)
    try:
        assert handle.result(timeout=20) == 42
    finally:
        assert extension.worker is not None
        assert extension.worker.stop()
    time.sleep(0)
