"""The core pages and actions, on SQLite and on PostgreSQL."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

import errands
from errands.backends.base import WorkerInfo
from errands.dashboard import create_app

from .helpers import BASE_URL, EMAIL, csrf_of, define_jobs, finish_due, login, post

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
ALICE = "dashboard:alice (shared password)"  # the audit actor of the signed-in client


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, db_url: str) -> Iterator[errands.App]:
    url = db_url if request.param == "sqlite" else request.getfixturevalue("pg_url")
    application = errands.App(url)
    yield application
    application.close()


@pytest.fixture
def jobs(store: errands.App) -> dict[str, Any]:
    return define_jobs(store)


@pytest.fixture
def client(store: errands.App, jobs: dict[str, Any]) -> Iterator[TestClient]:
    with TestClient(
        create_app(store, password="pw"), base_url=BASE_URL, client=("127.0.0.1", 1)
    ) as test_client:
        yield login(test_client, secret="pw", user="alice")


def ids_on(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<td class="num"><a href="/jobs/(\d+)">', html)]


def test_overview_shows_counts_oldest_age_and_charts_per_queue(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    for i in range(3):
        jobs["charge"].enqueue(order_id=i)
    finish_due(store, "payments", "completed")
    jobs["charge"].enqueue(order_id=9)
    finish_due(store, "payments", "dead")
    jobs["send_welcome"].enqueue(user_id=1, email=EMAIL)
    html = client.get("/").text
    assert "payments" in html and "emails" in html
    assert html.count('<rect class="bar completed"') >= 2  # the big chart and the queue's
    assert '<rect class="bar failed"' in html
    assert '<path class="rate"' in html
    assert "3 completed" in html and "1 failed attempts" in html and "1 dead" in html
    assert 'href="/dlq?queue=payments"' in html
    assert "25.0 %" in html  # one failed attempt of four
    assert 'hx-trigger="every 5s"' in html


def test_overview_names_pending_job_types_no_live_worker_defines(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    """A worker never claims a job type its code does not define: the overview lists the
    pending jobs no live worker defines, and only while none does."""
    jobs["charge"].enqueue(order_id=1)
    store.backend.worker_register(
        WorkerInfo("w-emails", "host", 1, "emails", 2, "0", jobs=(jobs["send_welcome"].name,))
    )
    html = client.get("/").text
    assert 'id="unrunnable"' in html and jobs["charge"].name in html
    store.backend.worker_register(
        WorkerInfo("w-pay", "host", 2, "payments", 2, "0", jobs=(jobs["charge"].name,))
    )
    assert 'id="unrunnable"' not in client.get("/").text


def test_jobs_page_filters_by_state_queue_and_name(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    mail = jobs["send_welcome"].enqueue(user_id=1, email=EMAIL)
    first = jobs["charge"].enqueue(order_id=1)
    second = jobs["charge"].enqueue(order_id=2)
    assert finish_due(store, "payments", "dead", limit=1) == [first.id]
    assert ids_on(client.get("/jobs").text) == [second.id, first.id, mail.id]
    assert ids_on(client.get("/jobs?queue=emails").text) == [mail.id]
    assert ids_on(client.get("/jobs?name=billing.charge").text) == [second.id, first.id]
    assert ids_on(client.get("/jobs?state=dead").text) == [first.id]
    assert ids_on(client.get("/jobs?state=available&name=billing.charge").text) == [second.id]
    assert ids_on(client.get("/jobs?state=dead&queue=emails").text) == []
    assert client.get("/jobs?state=sleeping").status_code == 400


def test_jobs_page_finds_a_job_by_id_or_idempotency_key(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    keyed = jobs["charge"].enqueue(order_id=5, key="order-5")
    other = jobs["send_welcome"].enqueue(user_id=5, email=EMAIL, key="order-5")
    jobs["charge"].enqueue(order_id=6, key="order-6")
    assert ids_on(client.get("/jobs", params={"q": "order-5"}).text) == [other.id, keyed.id]
    assert ids_on(client.get("/jobs", params={"q": str(keyed.id)}).text) == [keyed.id]
    assert ids_on(client.get("/jobs", params={"q": "nothing-like-it"}).text) == []


def test_jobs_page_pages_through_every_job_once_newest_first(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    store.enqueue_many([jobs["charge"].bind(order_id=i) for i in range(120)])
    seen: list[int] = []
    url: str | None = "/jobs?queue=payments"
    pages = 0
    while url:
        html = client.get(url).text
        seen.extend(ids_on(html))
        match = re.search(r'<a href="(/jobs\?[^"]*before_id=\d+)" rel="next">', html)
        url = match.group(1).replace("&amp;", "&") if match else None
        pages += 1
    assert pages == 3
    assert seen == sorted(seen, reverse=True) and len(set(seen)) == 120


def test_available_jobs_of_a_queue_page_in_the_order_they_will_be_claimed(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    """The available jobs of one queue come by priority, then due time (next to run
    first), the pager says so and walks every one of them once."""
    low = store.enqueue_many([jobs["charge"].bind(order_id=i) for i in range(60)])
    high = store.enqueue_many([jobs["charge"].bind(order_id=i, priority=5) for i in range(60, 90)])
    seen: list[int] = []
    url: str | None = "/jobs?state=available&queue=payments"
    while url:
        html = client.get(url).text
        assert "a plain queue&#39;s claim order" in html or "a plain queue's claim order" in html
        seen.extend(ids_on(html))
        match = re.search(r'<a href="(/jobs\?[^"]*after=[^"]+)" rel="next">Later', html)
        url = match.group(1).replace("&amp;", "&") if match else None
    assert seen == [h.id for h in high] + [h.id for h in low]


def test_job_detail_shows_arguments_attempts_timeline_and_trace(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    bound = jobs["send_welcome"].bind(user_id=7, email=EMAIL)
    bound.request.meta["traceparent"] = f"00-{TRACE}-00f067aa0ba902b7-01"
    [handle] = store.enqueue_many([bound])
    finish_due(store, "emails", "dead", message=f"mail server refused {EMAIL}")
    html = client.get(f"/jobs/{handle.id}").text
    assert "emails.send_welcome" in html and "s-dead" in html
    assert "&#34;user_id&#34;: 7" in html and "&#34;email&#34;: &#34;***&#34;" in html
    assert EMAIL not in html
    assert "attempt 1" in html and "ConnectionError" in html and "Traceback" in html
    assert TRACE in html
    assert "enqueued" in html and "attempt 1 failed" in html
    assert client.get("/jobs/999999").status_code == 404


def test_replay_from_the_job_page_is_audited_with_the_user(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    handle = jobs["charge"].enqueue(order_id=1)
    finish_due(store, "payments", "dead")
    response = post(client, f"/jobs/{handle.id}/replay", page=f"/jobs/{handle.id}")
    assert response.status_code == 303
    assert store.get_job(handle.id).state.value == "available"
    [event] = store.audit(job_id=handle.id)
    assert (event.action, event.actor) == ("replay", ALICE)
    page = client.get(f"/jobs/{handle.id}").text
    assert "1 job(s) replayed" in page and f"replay by {ALICE}" in page


def test_discard_needs_a_reason_and_records_it(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    handle = jobs["charge"].enqueue(order_id=1)
    finish_due(store, "payments", "dead")
    post(client, f"/jobs/{handle.id}/discard", {"reason": "  "})
    assert store.get_job(handle.id).state.value == "dead"
    assert "needs a reason" in client.get(f"/jobs/{handle.id}").text
    post(client, f"/jobs/{handle.id}/discard", {"reason": "customer refunded"})
    job = store.get_job(handle.id)
    assert job.state.value == "discarded" and job.discard_reason == "customer refunded"
    assert job.discarded_by == ALICE
    [event] = store.audit(job_id=handle.id)
    assert event.action == "discard" and event.detail["reason"] == "customer refunded"


def test_cancel_a_pending_job(store: errands.App, jobs: dict[str, Any], client: TestClient) -> None:
    handle = jobs["charge"].enqueue(order_id=1)
    page = client.get(f"/jobs/{handle.id}").text
    assert ">Cancel<" in page
    post(client, f"/jobs/{handle.id}/cancel")
    assert store.get_job(handle.id).state.value == "cancelled"
    [event] = store.audit(job_id=handle.id)
    assert (event.action, event.actor) == ("cancel", ALICE)
    post(client, f"/jobs/{handle.id}/cancel")  # a second time: a clear message, no crash
    assert "only scheduled, available" in client.get(f"/jobs/{handle.id}").text


def test_dlq_replays_the_selected_jobs_after_a_dry_run_count(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    handles = [jobs["charge"].enqueue(order_id=i) for i in range(3)]
    finish_due(store, "payments", "dead")
    listing = client.get("/dlq").text
    assert sorted(ids_on(listing)) == [h.id for h in handles]
    chosen = [handles[0].id, handles[2].id]
    preview = post(client, "/dlq/preview", {"op": "replay", "ids": chosen}, page="/dlq")
    assert preview.status_code == 200
    assert 'class="count-preview">2<' in preview.text
    assert all(store.get_job(h.id).state.value == "dead" for h in handles)  # a dry run
    assert store.audit() == []
    apply = client.post(
        "/dlq/apply",
        data={
            "csrf_token": csrf_of(preview.text),
            "op": "replay",
            "scope": "selected",
            "ids": re.search(r'name="ids" value="([^"]*)"', preview.text).group(1),  # type: ignore[union-attr]
        },
        follow_redirects=False,
    )
    assert apply.status_code == 303
    states = {h.id: store.get_job(h.id).state.value for h in handles}
    assert states == {handles[0].id: "available", handles[1].id: "dead", handles[2].id: "available"}
    assert sorted(e.job_id for e in store.audit()) == sorted(chosen)
    assert {e.actor for e in store.audit()} == {ALICE}
    assert "2 job(s) replayed" in client.get("/dlq").text


def test_dlq_discards_every_dead_job_of_a_queue_with_a_reason(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    paid = [jobs["charge"].enqueue(order_id=i) for i in range(2)]
    finish_due(store, "payments", "dead")
    mail = jobs["send_welcome"].enqueue(user_id=1, email=EMAIL)
    finish_due(store, "emails", "dead")
    form = {"op": "discard", "scope": "all", "queue": "payments", "reason": "duplicate orders"}
    no_reason = post(client, "/dlq/preview", {**form, "reason": ""}, page="/dlq")
    assert no_reason.status_code == 303
    preview = post(client, "/dlq/preview", form, page="/dlq?queue=payments")
    assert 'class="count-preview">2<' in preview.text
    confirm = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', preview.text))
    client.post("/dlq/apply", data=confirm, follow_redirects=False)
    assert {store.get_job(h.id).state.value for h in paid} == {"discarded"}
    assert store.get_job(mail.id).state.value == "dead"
    assert {(e.action, e.actor, e.detail.get("reason")) for e in store.audit()} == {
        ("discard", ALICE, "duplicate orders")
    }


def test_workers_page_shows_heartbeat_age_and_in_flight_jobs(
    store: errands.App, client: TestClient
) -> None:
    store.backend.worker_register(
        WorkerInfo(id="w-abc123", host="box-1", pid=4242, queues="emails,payments",
                   concurrency=8, version="0.1.0")
    )  # fmt: skip
    store.backend.worker_heartbeat("w-abc123", in_flight=3, processed=17)
    html = client.get("/workers").text
    assert "w-abc123" in html and "box-1" in html and "4242" in html
    assert '<td class="num">3</td>' in html and "3 jobs in flight" in html
    assert "ago" in html


def test_audit_page_lists_actions_and_filters_by_job(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    first = jobs["charge"].enqueue(order_id=1)
    second = jobs["charge"].enqueue(order_id=2)
    store.cancel(first.id, actor="cli:root@box")
    store.cancel(second.id, actor="someone-else")
    html = client.get("/audit").text
    assert "cli:root@box" in html and "someone-else" in html
    only = client.get(f"/audit?job_id={first.id}").text
    assert "cli:root@box" in only and "someone-else" not in only


def test_queues_page_pauses_and_resumes_a_queue_with_the_user_audited(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    store.queue("payments", limit=5, rate="100/m")
    store.backend.queue_declare(store.queues["payments"], "worker:w-1")  # as a worker does
    html = client.get("/queues").text
    assert "payments" in html and "100/m" in html and 'action="/queues/payments/pause"' in html
    assert post(client, "/queues/payments/pause", page="/queues").status_code == 303
    assert {s.name: s.paused for s in store.queue_settings()}["payments"] is True
    html = client.get("/queues").text
    assert "Queue payments paused." in html and 'action="/queues/payments/resume"' in html
    assert "paused" in client.get("/").text
    post(client, "/queues/payments/resume", page="/queues")
    assert {s.name: s.paused for s in store.queue_settings()}["payments"] is False
    events = [(e.action, e.actor, e.detail) for e in store.audit()]
    assert events == [
        ("resume", ALICE, {"queue": "payments"}),
        ("pause", ALICE, {"queue": "payments"}),
    ]


def test_a_fair_queue_links_to_its_tenants_with_their_share_of_worker_time_and_dwell(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    store.queue("reports", fair=True, aging=60)
    store.backend.queue_declare(store.queues["reports"], "worker:w-1")  # as a worker does

    @store.job(name="reports.build", queue="reports", fair_key="tenant:{tenant}")
    def build(tenant: str) -> None:
        pass

    store.enqueue_many([build.bind(tenant=t) for t in ("acme", "acme", "globex")])
    store.fair_weight("tenant:acme", 3)
    assert len(finish_due(store, "reports", "completed")) == 3
    html = client.get("/queues").text
    assert 'href="/queues/reports/tenants"' in html
    html = client.get("/queues/reports/tenants").text
    assert "Tenants of" in html and "tenant:acme" in html and "tenant:globex" in html
    assert "one priority level" in html  # aging is described
    assert '<td class="num">3</td>' in html  # acme's weight
    assert "not fair" in client.get("/queues/emails/tenants").text


def test_cron_page_shows_next_and_last_runs(store: errands.App, client: TestClient) -> None:
    @store.periodic("*/5 * * * *", name="reports.nightly_totals")
    def nightly_totals() -> None:
        pass

    html = client.get("/cron").text
    assert "reports.nightly_totals" in html and "*/5 * * * *" in html
    assert "UTC" in html and "never" in html


def test_job_detail_shows_stored_steps_and_children(
    store: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    parent = jobs["send_welcome"].enqueue(user_id=3, email=EMAIL)
    store.backend.step_store(parent.id, "render_template", '{"subject": "Welcome"}', 1)
    store.backend.step_store(parent.id, "smtp_send", f'"sent to {EMAIL}"', 1)
    child = jobs["charge"].bind(order_id=77)
    child.request.parent_id = parent.id
    [child_handle] = store.enqueue_many([child])
    html = client.get(f"/jobs/{parent.id}").text
    assert "render_template" in html and "Welcome" in html and "smtp_send" in html
    assert EMAIL not in html  # a step result quoting a sensitive argument is masked
    assert f'href="/jobs/{child_handle.id}"' in html
    child_page = client.get(f"/jobs/{child_handle.id}").text
    assert f'href="/jobs/{parent.id}">job {parent.id}</a>' in child_page


def test_crafted_ids_and_nested_json_get_a_clear_answer_not_a_500(
    client: TestClient, jobs: dict[str, Any]
) -> None:
    """A 30-digit id in a path reached the store (OverflowError: a bare 500); a signal
    payload nested 100,000 deep raised RecursionError past the JSON check (a 500 too)."""
    huge = "9" * 30
    for path in (f"/jobs/{huge}", f"/workflows/{huge}"):
        assert client.get(path).status_code == 404, path
    assert post(client, f"/jobs/{huge}/cancel").status_code == 404
    job = jobs["send_welcome"].enqueue(user_id=1, email=EMAIL, delay=3600)
    answer = post(client, f"/jobs/{job.id}/signal", {"signal": "go", "payload": "[" * 100_000})
    assert answer.status_code == 303  # back to the job, the error flashed
    assert "not JSON" in client.get(f"/jobs/{job.id}").text


def test_an_id_of_zero_in_a_query_or_search_is_ignored_not_a_500(
    client: TestClient, jobs: dict[str, Any]
) -> None:
    """The App refuses id 0 (ConfigurationError); the dashboard's id fields read "0"
    as an id, which reached it: ?before_id=0 and a search for 0 were a bare 500."""
    dead = jobs["send_welcome"].enqueue(user_id=1, email=EMAIL)
    for path in (
        "/jobs?before_id=0",
        "/jobs?q=0",
        "/jobs?q=000",
        "/dlq?before_id=0",
        "/audit?job_id=0",
        "/workflows?before=0",
    ):
        assert client.get(path).status_code == 200, path
    for ids in ("0", f"0,{dead.id}"):
        answer = post(client, "/dlq/preview", {"op": "replay", "ids": ids}, page="/dlq")
        assert answer.status_code < 500, ids


def test_a_signal_payload_json_cannot_hold_is_refused_with_a_clear_message(
    store: errands.App, client: TestClient, jobs: dict[str, Any]
) -> None:
    """NaN, Infinity and a NUL escape passed the form's JSON check: stored as JSON no
    standard reader takes on SQLite, a raw driver error (a 500) on PostgreSQL."""
    job = jobs["send_welcome"].enqueue(user_id=1, email=EMAIL, delay=3600)
    for payload in ('{"total": NaN}', "[1e999]", '"a\\u0000b"'):
        answer = post(client, f"/jobs/{job.id}/signal", {"signal": "go", "payload": payload})
        assert answer.status_code == 303, payload
        page = client.get(f"/jobs/{job.id}").text
        assert "signal &#39;go&#39;: the payload: " in page, payload
        assert "sent to job" not in page, payload
    assert store.audit(job_id=job.id) == []


@pytest.mark.parametrize(
    ("field", "value", "quoted_as"),
    [
        ("run_at", "\N{CJK UNIFIED IDEOGRAPH-4E2D}" * 20_000, "Cannot edit: run at '"),
        ("delay", "x" * 20_000, "Cannot edit: delay '"),
        ("priority", "9" * 20_000, "Cannot edit: priority '"),
        ("queue", "\N{GRINNING FACE}" * 5_000, None),  # the App's own error, clipped
    ],
)
def test_an_error_quoting_a_huge_input_keeps_the_session_cookie_small(
    store: errands.App,
    client: TestClient,
    jobs: dict[str, Any],
    field: str,
    value: str,
    quoted_as: str | None,
) -> None:
    """fromisoformat and float quote their whole input: a 20 KB run at became a flash
    message, and the session cookie holding it a 27 KB Set-Cookie browsers drop (the
    user's session went with it). Messages are clipped; the input is quoted in part."""
    job = jobs["charge"].enqueue(order_id=1, delay=3600)
    token = csrf_of(client.get("/jobs").text)
    answer = client.post(
        "/jobs/edit/preview",
        data={"csrf_token": token, "ids": str(job.id), field: value},
        follow_redirects=False,
    )
    assert answer.status_code == 303
    assert len(answer.headers["set-cookie"]) < 4096, len(answer.headers["set-cookie"])
    page = client.get("/jobs").text
    [shown] = re.findall(r'<div class="flash error" role="status">([^<]*)</div>', page)
    shown = html.unescape(shown)
    assert len(json.dumps(shown)) < 310, shown
    if quoted_as is None:
        assert shown.endswith("..."), shown
    else:
        assert shown.startswith(quoted_as) and "...' is not a" in shown, shown
    assert store.get_job(job.id).queue == "payments"


def test_unicode_digits_in_ids_and_filters_get_a_clear_answer_not_a_500(
    client: TestClient, jobs: dict[str, Any]
) -> None:
    """``str.isdigit`` takes "²" and "٣", which int() then refuses: ``?before_id=²``,
    ``?search=²`` and a DLQ form's ids were bare 500s. They read as no id."""
    for path in ("/jobs?before_id=%C2%B2", "/jobs?search=%C2%B2", "/jobs?search=%D9%A3"):
        assert client.get(path).status_code == 200, path
    answer = post(client, "/dlq/preview", {"op": "replay", "ids": "²,٣"}, page="/dlq")
    assert answer.status_code < 500


def test_the_dashboard_leaves_a_host_apps_own_id_convertor_alone() -> None:
    """Its path convertor has a name of its own: registered as "id" (starlette's
    convertors are global), it replaced a host app's for the routes compiled after."""
    from starlette.convertors import CONVERTOR_TYPES

    import errands.dashboard  # noqa: F401

    assert "errands_id" in CONVERTOR_TYPES and "id" not in CONVERTOR_TYPES


def test_an_idempotency_key_quoting_a_sensitive_argument_is_masked_where_it_is_shown(
    store: errands.App, client: TestClient, jobs: dict[str, Any]
) -> None:
    """``key=f"welcome:{email}"`` with ``email`` sensitive: the key showed the address on
    the job page, the jobs list, ``jobs show`` and its JSON."""
    from click.testing import CliRunner

    from errands.cli.main import cli

    job = jobs["send_welcome"].enqueue(user_id=7, email=EMAIL, key=f"welcome:{EMAIL}", delay=60)
    for page in (client.get(f"/jobs/{job.id}"), client.get("/jobs")):
        assert page.status_code == 200
        assert "welcome:***" in page.text and EMAIL not in page.text
    for args in (["jobs", "show", str(job.id)], ["jobs", "show", str(job.id), "--json"]):
        shown = CliRunner().invoke(cli, [*args, "--url", store.url])
        assert "welcome:***" in shown.output and EMAIL not in shown.output, shown.output
