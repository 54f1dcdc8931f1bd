"""The errands task backend through Django's public Tasks API only.

``task.enqueue``, ``task.get_result``, ``TaskResult.refresh`` / ``status`` / ``errors`` /
``return_value``, ``using(run_after=..., priority=..., queue_name=...)``, the signals and
``transaction.atomic()``. The same tests run on SQLite and PostgreSQL, on Django 6
(``django.tasks``) and Django 5.2 with the ``django-tasks`` backport.

A worker sees committed jobs only, so these are ``TransactionTestCase``s with a worker in
a background thread (``run_worker``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from asgiref.sync import async_to_sync
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.test import SimpleTestCase, TestCase
from django.utils import timezone

from errands.contrib.django.test import TransactionTestCase, run_worker

from . import tasks
from .models import Order

try:
    from django.tasks import TaskResultStatus, task_backends
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started

    TASKS_LOGGER = "django.tasks"
except ImportError:  # Django 5.2 + django-tasks
    from django_tasks import TaskResultStatus, task_backends
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started

    try:
        from django_tasks.exceptions import InvalidTask
    except ImportError:  # django-tasks <= 0.12
        from django_tasks.exceptions import InvalidTaskError as InvalidTask

    TASKS_LOGGER = "django_tasks"

READY, RUNNING = TaskResultStatus.READY, TaskResultStatus.RUNNING
FAILED = TaskResultStatus.FAILED
# SUCCEEDED in django-tasks 0.11
SUCCESSFUL = TaskResultStatus.__members__.get("SUCCESSFUL") or TaskResultStatus["SUCCEEDED"]
WAIT = 20.0


class JobsTestCase(TransactionTestCase):
    # flush only this app's tables between tests (errands' are emptied by the base class)
    available_apps = ["backend_tests", "errands.contrib.django"]


def wait_for(result: Any, *statuses: Any, timeout: float = WAIT, errors: int = 0) -> Any:
    """Refresh ``result`` until its status is one of ``statuses`` (with at least
    ``errors`` errors recorded)."""
    deadline = time.monotonic() + timeout
    while True:
        result.refresh()
        if result.status in statuses and len(result.errors) >= errors:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(
                f"task result {result.id} is {result.status} with {len(result.errors)} "
                f"error(s) after {timeout} s; expected {statuses}"
            )
        time.sleep(0.02)


class BackendFeatures(TestCase):
    def test_the_backend_declares_what_it_supports(self) -> None:
        backend = task_backends["default"]
        self.assertEqual(type(backend).__name__, "ErrandsBackend")
        self.assertTrue(backend.supports_defer)
        self.assertTrue(backend.supports_async_task)
        self.assertTrue(backend.supports_get_result)
        self.assertTrue(backend.supports_priority)

    def test_a_worker_of_a_backend_with_empty_queues_serves_every_queue_its_tasks_name(
        self,
    ) -> None:
        """QUEUES: [] lets Django take any queue_name; the worker served "default" alone,
        and the tasks of the other queues were stored and never run."""
        from errands.contrib.django.app import get_app, serving_queues

        app = get_app()
        app.autodiscover()
        served = serving_queues({"QUEUES": []}, app)
        self.assertEqual({"default", "payments", "slow"} - set(served), set())
        self.assertEqual(serving_queues({}, app), ["default"])  # Django's own default
        self.assertEqual(serving_queues({"QUEUES": ["slow"]}, app), ["slow"])

    def test_system_checks_pass(self) -> None:
        call_command("check", verbosity=0)

    def test_enqueue_and_get_result_inside_a_test_transaction(self) -> None:
        # TestCase wraps each test in a transaction: the job is stored in it, and read
        # back through the same connection.
        result = tasks.add.enqueue(2, 3)
        self.assertEqual(result.status, READY)
        fetched = tasks.add.get_result(result.id)
        self.assertEqual((fetched.id, fetched.status), (result.id, READY))
        self.assertEqual((fetched.args, fetched.kwargs), ([2, 3], {}))


class Enqueue(JobsTestCase):
    def test_enqueue_returns_a_ready_result(self) -> None:
        result = tasks.add.enqueue(1, b=2)
        self.assertEqual(result.status, READY)
        self.assertIsInstance(result.id, str)
        self.assertEqual(result.args, [1])
        self.assertEqual(result.kwargs, {"b": 2})
        self.assertEqual(result.backend, "default")
        self.assertIsNotNone(result.enqueued_at)
        self.assertFalse(result.is_finished)
        with self.assertRaises(ValueError):
            result.return_value  # noqa: B018 - not finished yet

        fetched = tasks.add.get_result(result.id)
        self.assertEqual(fetched.status, READY)
        self.assertEqual(fetched.task.func, tasks.add.func)
        self.assertEqual((fetched.args, fetched.kwargs), ([1], {"b": 2}))
        self.assertIsNotNone(fetched.enqueued_at)
        self.assertIsNone(fetched.started_at)
        self.assertEqual((fetched.errors, fetched.worker_ids), ([], []))

    def test_enqueue_returns_the_stored_enqueued_at_so_it_equals_get_result(self) -> None:
        result = tasks.add.enqueue(4, 5)
        fetched = tasks.add.get_result(result.id)
        self.assertEqual(result.enqueued_at, fetched.enqueued_at)
        self.assertEqual(result, fetched)
        before = result.enqueued_at
        result.refresh()
        self.assertEqual(result.enqueued_at, before)  # the first refresh changes nothing

    def test_unknown_result_ids_do_not_exist(self) -> None:
        for missing in ("999999999", "not-a-number", ""):
            with self.subTest(missing=missing), self.assertRaises(TaskResultDoesNotExist):
                tasks.add.get_result(missing)

    def test_queue_names_are_validated(self) -> None:
        with self.assertRaises(InvalidTask):
            tasks.add.using(queue_name="not-configured")
        tasks.add.using(queue_name="payments")  # one of QUEUES

    def test_priority_is_validated(self) -> None:
        with self.assertRaises(InvalidTask):
            tasks.add.using(priority=101)
        result = tasks.add.using(priority=100).enqueue(1, 1)
        self.assertEqual(tasks.add.get_result(result.id).task.priority, 100)

    def test_run_after_must_be_aware(self) -> None:
        with self.assertRaises(InvalidTask):
            tasks.add.using(run_after=timezone.now().replace(tzinfo=None))

    def test_arguments_that_do_not_fit_the_signature_store_nothing(self) -> None:
        from errands import InvalidPayload

        with self.assertRaises(InvalidPayload):
            tasks.add.enqueue(1, 2, 3)
        with self.assertRaises(TypeError):  # Django's rule: JSON arguments only
            tasks.add.enqueue(1, object())

    def test_key_deduplicates(self) -> None:
        first = tasks.pay_once.enqueue(7)
        second = tasks.pay_once.enqueue(7, note="again")
        self.assertEqual(first.id, second.id)
        self.assertNotEqual(tasks.pay_once.enqueue(8).id, first.id)
        explicit = tasks.pay_once.using(key="pay:7:refund").enqueue(7)
        self.assertNotEqual(explicit.id, first.id)

    def test_a_task_unique_for_a_period_needs_a_key_at_each_enqueue(self) -> None:
        from errands import ConfigurationError

        with self.assertRaisesMessage(ConfigurationError, 'task.using(key="...")'):
            tasks.once_a_minute.enqueue(1)
        first = tasks.once_a_minute.using(key="minute:1").enqueue(1)
        self.assertEqual(tasks.once_a_minute.using(key="minute:1").enqueue(1).id, first.id)

    def test_a_concurrency_key_over_the_key_limit_is_refused_and_stores_nothing(self) -> None:
        """A task's concurrency_key skipped the length check every other key gets: a
        3,200-byte key was stored, and on PostgreSQL every claim of the job then failed
        (ProgramLimitExceeded: index row size exceeds btree maximum), for ever."""
        from errands import InvalidPayload

        before = len(task_backends["default"].app.jobs())
        with self.assertRaisesMessage(InvalidPayload, "concurrency_key is 3,208 bytes"):
            tasks.per_account.enqueue("a" * 3200)
        self.assertEqual(len(task_backends["default"].app.jobs()), before)
        self.assertEqual(tasks.per_account.enqueue("a" * 900).status, READY)

    def test_aenqueue(self) -> None:
        result = async_to_sync(tasks.add.aenqueue)(20, 22)
        self.assertEqual(result.status, READY)
        fetched = async_to_sync(tasks.add.aget_result)(result.id)
        self.assertEqual(fetched.args, [20, 22])

    def test_migrate_is_idempotent(self) -> None:
        call_command("migrate", "errands", verbosity=0)


class Transactions(JobsTestCase):
    """Enqueue writes through Django's connection: the job is part of the caller's
    transaction."""

    def test_rolled_back_atomic_block_keeps_neither_the_order_nor_the_job(self) -> None:
        enqueued: list[Any] = []

        def on_enqueued(sender: Any, task_result: Any, **kwargs: Any) -> None:
            enqueued.append(task_result)

        task_enqueued.connect(on_enqueued)
        result_ids = []
        try:
            with self.assertRaises(RuntimeError), transaction.atomic():
                order = Order.objects.create(number="A-1")
                result = tasks.mark_paid.enqueue(order.id)
                result_ids.append(result.id)
                # inside the transaction the job is there, READY
                self.assertEqual(tasks.mark_paid.get_result(result.id).status, READY)
                raise RuntimeError("payment page crashed")
        finally:
            task_enqueued.disconnect(on_enqueued)
        self.assertFalse(Order.objects.exists())
        with self.assertRaises(TaskResultDoesNotExist):
            tasks.mark_paid.get_result(result_ids[0])
        self.assertEqual([r for r in enqueued if r.id == result_ids[0]], [])

    def test_committed_atomic_block_keeps_both_and_the_job_runs(self) -> None:
        enqueued: list[Any] = []

        def on_enqueued(sender: Any, task_result: Any, **kwargs: Any) -> None:
            enqueued.append(task_result.id)

        task_enqueued.connect(on_enqueued)
        try:
            with transaction.atomic():
                order = Order.objects.create(number="A-2")
                result = tasks.mark_paid.enqueue(order.id)
                self.assertEqual(enqueued, [])  # sent once the transaction commits
            self.assertEqual(enqueued, [result.id])
        finally:
            task_enqueued.disconnect(on_enqueued)
        with run_worker():
            wait_for(result, SUCCESSFUL)
        self.assertIs(result.return_value, True)
        order.refresh_from_db()
        self.assertTrue(order.paid)

    def test_rolled_back_savepoint_drops_only_its_job(self) -> None:
        with transaction.atomic():
            kept = tasks.add.enqueue(1, 1)
            with self.assertRaises(RuntimeError), transaction.atomic():
                dropped = tasks.add.enqueue(2, 2)
                raise RuntimeError("inner block fails")
        self.assertEqual(tasks.add.get_result(kept.id).status, READY)
        with self.assertRaises(TaskResultDoesNotExist):
            tasks.add.get_result(dropped.id)


class Execution(JobsTestCase):
    def setUp(self) -> None:
        tasks.entered.clear()
        tasks.release.clear()
        tasks.calls.clear()

    def tearDown(self) -> None:
        tasks.release.set()

    def test_status_moves_ready_running_successful(self) -> None:
        result = tasks.blocking.enqueue("t-1")
        self.assertEqual(tasks.blocking.get_result(result.id).status, READY)
        with run_worker():
            self.assertTrue(tasks.entered.wait(WAIT), "the worker never started the task")
            running = tasks.blocking.get_result(result.id)
            self.assertEqual(running.status, RUNNING)
            self.assertIsNotNone(running.started_at)
            self.assertIsNone(running.finished_at)
            self.assertEqual(running.attempts, 1)
            tasks.release.set()
            done = wait_for(result, SUCCESSFUL)
        self.assertEqual(done.return_value, "t-1")
        self.assertTrue(done.is_finished)
        self.assertIsNotNone(done.finished_at)
        self.assertGreaterEqual(done.finished_at, done.started_at)
        self.assertEqual(done.attempts, 1)
        self.assertEqual(done.errors, [])

    def test_a_failing_task_retries_then_fails_with_every_error_recorded(self) -> None:
        result = tasks.always_fails.enqueue("boom")
        with run_worker():
            # after the first failure it is READY again, waiting out its backoff
            between = wait_for(result, READY, errors=1)
            self.assertEqual(between.status, READY)
            self.assertEqual(len(between.errors), 1)
            failed = wait_for(result, FAILED)
        self.assertEqual(len(failed.errors), 2)  # retries=1: two attempts
        self.assertEqual(failed.attempts, 2)
        for error in failed.errors:
            self.assertIs(error.exception_class, ValueError)
            self.assertIn("ValueError: boom", error.traceback)
        self.assertIsNotNone(failed.finished_at)
        with self.assertRaises(ValueError):
            failed.return_value  # noqa: B018 - a failed task has no return value

    def test_a_permanent_exception_fails_at_once(self) -> None:
        result = tasks.charge.enqueue(42)
        with run_worker():
            failed = wait_for(result, FAILED)
        self.assertEqual(len(failed.errors), 1)
        self.assertIs(failed.errors[0].exception_class, tasks.CardDeclined)
        self.assertIn("card declined for order 42", failed.errors[0].traceback)
        self.assertEqual(failed.task.queue_name, "payments")

    def test_a_non_json_return_value_fails_with_the_type_error_as_its_exception_class(
        self,
    ) -> None:
        result = tasks.returns_object.enqueue()
        with run_worker():
            failed = wait_for(result, FAILED)
        self.assertEqual(len(failed.errors), 1)
        self.assertIs(failed.errors[0].exception_class, TypeError)
        self.assertIn("not JSON", failed.errors[0].traceback)
        self.assertIn("TypeError", failed.errors[0].traceback)

    def test_djangos_failed_task_log_line_carries_the_tasks_exception(self) -> None:
        result = tasks.charge.enqueue(7)
        with self.assertLogs(TASKS_LOGGER, level="ERROR") as logs, run_worker():
            wait_for(result, FAILED)
            deadline = time.monotonic() + WAIT
            while not logs.records:  # task_finished is sent once the outcome is written
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.02)
        [record] = [r for r in logs.records if result.id in r.getMessage()]
        self.assertIsNotNone(record.exc_info)
        self.assertIs(record.exc_info[0], tasks.CardDeclined)
        self.assertIn("card declined for order 7", str(record.exc_info[1]))

    def test_run_after_defers_the_task(self) -> None:
        run_after = timezone.now() + timedelta(seconds=1.5)
        result = tasks.add.using(run_after=run_after).enqueue(3, 4)
        with run_worker():
            time.sleep(0.5)
            status = tasks.add.get_result(result.id).status
            if timezone.now() < run_after:  # (a loaded machine may start the worker late)
                self.assertEqual(status, READY)
            done = wait_for(result, SUCCESSFUL)
        self.assertEqual(done.return_value, 7)
        self.assertGreaterEqual(done.started_at, run_after - timedelta(milliseconds=100))
        stored = tasks.add.get_result(result.id).task.run_after
        self.assertIsNotNone(stored)
        self.assertLess(abs((stored - run_after).total_seconds()), 0.01)

    def test_higher_priority_runs_first(self) -> None:
        low = tasks.record.using(priority=-10).enqueue("low")
        middle = tasks.record.enqueue("middle")
        high = tasks.record.using(priority=10).enqueue("high")
        with run_worker(queues=["default"], concurrency=1):
            for result in (low, middle, high):
                wait_for(result, SUCCESSFUL)
        self.assertEqual(tasks.calls, ["high", "middle", "low"])

    def test_async_task(self) -> None:
        result = tasks.async_double.enqueue(21)
        with run_worker():
            self.assertEqual(wait_for(result, SUCCESSFUL).return_value, 42)

    def test_an_async_task_starts_with_its_orm_connections_checked_as_a_sync_one(
        self,
    ) -> None:
        """Only sync tasks ran close_old_connections(): an async task's ORM connection
        (past CONN_MAX_AGE, or broken by a database restart) stayed for every later one."""
        with run_worker():
            for n in range(2):  # one after the other: the second sees what the first left
                result = tasks.orm_async_probe.enqueue(n)
                self.assertIs(wait_for(result, SUCCESSFUL).return_value, True)

    def test_each_job_closes_the_caches_it_used(self) -> None:
        """Each job runs in a context of its own, as a request does: the cache instance it
        opened (a Redis client with its connections, for one) is closed at its end, as
        Django's close_caches does at a request's, not left to the garbage collector."""
        from . import caching

        before = len(caching.closed)
        with run_worker(concurrency=1):
            for n in range(3):
                done = wait_for(tasks.uses_the_cache.enqueue(n), SUCCESSFUL)
                self.assertEqual(done.return_value, n)
        self.assertGreaterEqual(len(caching.closed) - before, 3)

    def test_task_context(self) -> None:
        result = tasks.with_context.enqueue(5)
        with run_worker():
            done = wait_for(result, SUCCESSFUL)
        self.assertEqual(done.return_value, {"attempt": 1, "id": result.id, "n": 5})

    def test_tasks_use_the_orm_in_the_worker(self) -> None:
        order = Order.objects.create(number="B-1")
        result = tasks.mark_paid.enqueue(order.id)
        with run_worker():
            wait_for(result, SUCCESSFUL)
        order.refresh_from_db()
        self.assertTrue(order.paid)

    def test_limited_tasks_run(self) -> None:
        results = [tasks.limited.enqueue(i % 2) for i in range(4)]
        with run_worker():
            for result in results:
                wait_for(result, SUCCESSFUL)

    def test_signals_follow_the_task(self) -> None:
        seen: list[tuple[str, str, Any]] = []

        def receiver(name: str) -> Any:
            def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
                seen.append((name, task_result.id, task_result.status))

            return receive

        receivers = {
            task_enqueued: receiver("enqueued"),
            task_started: receiver("started"),
            task_finished: receiver("finished"),
        }
        for sig, fn in receivers.items():
            sig.connect(fn)
        try:
            ok = tasks.add.enqueue(1, 2)
            bad = tasks.charge.enqueue(1)
            with run_worker():
                wait_for(ok, SUCCESSFUL)
                wait_for(bad, FAILED)
                deadline = time.monotonic() + WAIT
                while sum(1 for s in seen if s[0] == "finished") < 2:
                    self.assertLess(time.monotonic(), deadline, seen)
                    time.sleep(0.02)
        finally:
            for sig, fn in receivers.items():
                sig.disconnect(fn)
        self.assertEqual(
            [s for s in seen if s[1] == ok.id],
            [
                ("enqueued", ok.id, READY),
                ("started", ok.id, RUNNING),
                ("finished", ok.id, SUCCESSFUL),
            ],
        )
        self.assertEqual(
            [s[0] for s in seen if s[1] == bad.id], ["enqueued", "started", "finished"]
        )
        self.assertEqual([s[2] for s in seen if s[1] == bad.id][-1], FAILED)


class Rescues(JobsTestCase):
    def test_a_rescue_that_ends_a_task_sends_task_finished_once(self) -> None:
        """The maintenance leader rescues the jobs of a worker that died: one on its last
        attempt dies (task_finished once: it was sent for the rescue and again for the
        death), one whose cancel was asked while it ran is cancelled (it was never sent)."""
        from errands.backends.base import ClaimParams, QueueClaim
        from errands.contrib.django.app import get_app
        from errands.maintenance import Maintenance

        app = get_app()
        finished: list[str] = []

        def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
            finished.append(task_result.id)

        def claim_as_a_worker_that_dies(suspect: bool = False) -> int:
            claim = ClaimParams([QueueClaim("default", 1)], 1, "w-dies", 0.05, suspects=suspect)
            (row,) = app.backend.job_claim(claim)
            time.sleep(0.2)  # its lease runs out
            return row.id

        dies = tasks.always_fails.enqueue("lost")  # two attempts
        cancelled = tasks.add.enqueue(1, 2)
        rescuer = Maintenance(app, "w-rescuer")
        task_finished.connect(receive)
        try:
            self.assertEqual(claim_as_a_worker_that_dies(), int(dies.id))
            self.assertEqual(rescuer.rescue(), 1)  # retryable, 0.75 s later
            self.assertEqual(claim_as_a_worker_that_dies(), int(cancelled.id))
            app.cancel(int(cancelled.id), actor="ops")  # running: asked to stop
            time.sleep(1.0)
            self.assertEqual(claim_as_a_worker_that_dies(suspect=True), int(dies.id))
            self.assertEqual(rescuer.rescue(), 2)
        finally:
            task_finished.disconnect(receive)
        self.assertEqual(sorted(finished), sorted([dies.id, cancelled.id]))
        self.assertEqual(tasks.always_fails.get_result(dies.id).status, FAILED)


class WithTheTestingTools(JobsTestCase):
    """errands.testing's Tester on the backend's App: drain() runs the due tasks one at a
    time through the real worker code, moving its clock over retry backoffs."""

    def test_drain_runs_tasks_and_their_retries_without_sleeping(self) -> None:
        from errands.contrib.django import get_app
        from errands.testing import Tester

        with Tester(get_app()) as tester:
            ok = tasks.add.enqueue(1, 2)
            bad = tasks.always_fails.enqueue("boom")
            drained = tester.drain()
        self.assertEqual((drained.completed, drained.dead), (1, 1))
        self.assertEqual(tasks.add.get_result(ok.id).return_value, 3)
        failed = tasks.always_fails.get_result(bad.id)
        self.assertEqual((failed.status, len(failed.errors)), (FAILED, 2))


class ManagementCommand(JobsTestCase):
    def test_errands_worker_gives_its_prefetch_to_the_worker(self) -> None:
        """--prefetch N reaches the worker as prefetch=N (it had no --prefetch: every
        Django worker claimed the default 4 x -c beyond its slots)."""
        from unittest import mock

        from errands.app import App
        from errands.errors import ConfigurationError

        stop = ConfigurationError("stopped before the worker ran")
        with (
            mock.patch.object(App, "worker", autospec=True, side_effect=stop) as worker,
            self.assertRaisesMessage(CommandError, "stopped before the worker ran"),
        ):
            call_command("errands_worker", "-c", "3", "--prefetch", "7")
        options = worker.call_args.kwargs
        self.assertEqual((options["concurrency"], options["prefetch"]), (3, 7))

    def test_errands_worker_runs_tasks_and_stops_on_sigterm(self) -> None:
        result = tasks.add.enqueue(2, 40)
        here = Path(__file__).resolve().parent.parent
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "test_settings",
            "ERRANDS_DJANGO_DB_NAME": str(connection.settings_dict["NAME"]),
            "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
            "ERRANDS_TEST_LOGS": "1",  # the worker's logs, shown if this test fails
            "PYTHONFAULTHANDLER": "1",  # SIGABRT dumps every thread's stack
        }
        command = ["errands_worker", "--poll-interval", "0.05", "--grace", "5"]
        process = subprocess.Popen(
            [sys.executable, "-m", "django", *command, "--log-format", "text"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            done = wait_for(result, SUCCESSFUL, timeout=60)
            self.assertEqual(done.return_value, 42)
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            try:
                output, _ = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
            self.fail(f"the worker did not stop on SIGTERM:\n{output}")
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        self.assertEqual(process.returncode, 0, output)
        self.assertIn("errands worker", output)


class ManagementCommandOptions(SimpleTestCase):
    def test_the_worker_command_holds_its_counts_to_the_clis_bounds_before_anything_opens(
        self,
    ) -> None:
        """-c, --express and --prefetch are held to the bounds `errands worker` holds them
        to (its own check, each message naming the option and the bound), before the
        backend is even looked up. Only their lower bounds were checked here: -c 20000
        imported the tasks, served the metrics and read the schema before the worker
        refused it, and there was no --prefetch."""
        from unittest import mock

        cases = [
            (["-c", "20000"], "concurrency (-c) is 20,000: at most 10,000 ("),
            (["-c", "0"], "concurrency (-c) must be a whole number (an int) of at least 1"),
            (["--express", "20000"], "express (--express) is 20,000: at most 10,000 ("),
            (["--express", "-1"], "express (--express) must be a whole number (an int) of at least 0"),
            (["--prefetch", "20000"], "prefetch (--prefetch) is 20,000: at most 10,000 ("),
            (["--prefetch", "-1"], "prefetch (--prefetch) must be a whole number (an int) of at least 0"),
            (["-q", "a=6000,b=6000"], "concurrency (the sum of -q's per-queue limits) is 12,000"),
        ]  # fmt: skip
        opened = AssertionError("the backend was looked up before the counts were checked")
        with mock.patch("errands.contrib.django.app.backend_params", side_effect=opened):
            for argv, message in cases:
                with (
                    self.subTest(argv=argv),
                    self.assertRaisesMessage(CommandError, message),
                ):
                    call_command("errands_worker", *argv)

    def test_the_worker_command_refuses_several_processes_naming_what_to_do_instead(
        self,
    ) -> None:
        """`errands worker --processes N` re-runs its own command line for each child,
        which a management command cannot do faithfully: --processes other than 1 is
        refused, saying to run more of the command under a process manager, or raise -c
        (it was an unknown option: argparse's "unrecognized arguments")."""
        for n in ("2", "0"):
            with (
                self.subTest(processes=n),
                self.assertRaisesMessage(
                    CommandError,
                    f"--processes {n}: this command runs one worker process",
                ) as caught,
            ):
                call_command("errands_worker", "--processes", n)
            self.assertIn("under your process manager", str(caught.exception))
            self.assertIn("or raise -c", str(caught.exception))

    def test_the_worker_command_refuses_nan_or_infinite_seconds_naming_the_option(self) -> None:
        """float() reads "nan" and "inf", and the range checks let NaN through (it compares
        false with either bound): --poll-interval nan started a worker that never slept
        between claims, --grace inf one whose shutdown never ended. A usage error now,
        naming the option, as the errands CLI gives."""
        for option, value in [
            ("--grace", "nan"),
            ("--grace", "inf"),
            ("--poll-interval", "nan"),
            ("--poll-interval", "inf"),
            ("--maintenance-tick", "nan"),
        ]:
            with (
                self.subTest(option=option, value=value),
                self.assertRaisesMessage(
                    CommandError,
                    f"argument {option}: {value!r} is not a finite number; give seconds",
                ),
            ):
                call_command("errands_worker", option, value)

    def test_the_worker_command_refuses_an_empty_queues_option_naming_the_fix(self) -> None:
        """--queues "" (an unset $QUEUE in a deploy script) was read as no --queues at all:
        the worker silently served the backend's QUEUES. As ``errands worker -q ""``
        does, it is refused, before anything is opened, saying how to fix it."""
        for spec in ["", " ", ","]:
            with (
                self.subTest(spec=spec),
                self.assertRaisesMessage(
                    CommandError,
                    f"--queues {spec!r} names no queue (an unset $QUEUE?): name them, as in "
                    "--queues emails,payments, or leave --queues out to serve the backend's "
                    "QUEUES",
                ),
            ):
                call_command("errands_worker", "--queues", spec)
