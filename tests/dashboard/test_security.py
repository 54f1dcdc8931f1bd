"""The dashboard's security: login, CSRF, rights, escaping, masking, headers, binding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from html import unescape
from typing import Any

import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

import errands
from errands.cli.main import cli
from errands.dashboard import actions, create_app, header_user
from errands.dashboard.security import AuthConfig, is_loopback_host, refuse_open_bind
from errands.errors import ConfigurationError

from .helpers import (
    BASE_URL,
    EMAIL,
    PASSWORD,
    TOKEN,
    XSS,
    csrf_of,
    dead_job,
    finish_due,
    login,
    post,
)

PAGES = ["/", "/jobs", "/jobs/1", "/dlq", "/queues", "/workers", "/cron", "/audit"]
ACTIONS = [
    ("/jobs/1/cancel", {}),
    ("/jobs/1/replay", {}),
    ("/jobs/1/discard", {"reason": "spam"}),
    ("/jobs/1/signal", {"signal": "approved", "payload": "{}"}),
    ("/jobs/edit/preview", {"ids": "1", "priority": "5"}),
    ("/jobs/edit/apply", {"ids": "1", "priority": "5"}),
    ("/dlq/preview", {"op": "replay", "ids": "1"}),
    ("/dlq/apply", {"op": "replay", "ids": "1"}),
    ("/queues/emails/pause", {}),
    ("/queues/emails/resume", {}),
    ("/logout", {}),
]


@pytest.mark.parametrize("path", PAGES)
def test_every_page_sends_a_signed_out_visitor_to_the_login_page(
    make_client: Callable[..., TestClient], path: str
) -> None:
    client = make_client(signed_in=False)
    response = client.get(path, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"].startswith("/login?next=")


@pytest.mark.parametrize(("path", "data"), ACTIONS)
def test_every_action_is_refused_without_a_session(
    app: errands.App,
    jobs: dict[str, Any],
    make_client: Callable[..., TestClient],
    path: str,
    data: dict[str, Any],
) -> None:
    job_id = dead_job(app, jobs)
    client = make_client(signed_in=False)
    token = csrf_of(client.get("/login").text)  # even with the login form's valid token
    response = client.post(path, data={"csrf_token": token, **data}, follow_redirects=False)
    assert response.status_code == 401
    assert app.get_job(job_id).state.value == "dead"
    assert app.audit() == []


@pytest.mark.parametrize(("path", "data"), ACTIONS)
def test_every_action_without_the_csrf_token_is_rejected(
    app: errands.App, jobs: dict[str, Any], client: TestClient, path: str, data: dict[str, Any]
) -> None:
    job_id = dead_job(app, jobs)
    missing = client.post(path, data=data, follow_redirects=False)
    wrong = client.post(path, data={"csrf_token": "forged", **data}, follow_redirects=False)
    assert missing.status_code == wrong.status_code == 403
    assert "CSRF" in missing.text
    assert app.get_job(job_id).state.value == "dead"
    assert app.audit() == []
    assert client.get("/", follow_redirects=False).status_code == 200  # still signed in


def _post_from(client: TestClient, origin: str, path: str) -> Any:
    """A POST with the page's CSRF token, as a browser sends it from a page at ``origin``."""
    token = csrf_of(client.get("/").text)
    return client.post(
        path, data={"csrf_token": token}, headers={"origin": origin}, follow_redirects=False
    )


def test_a_form_posted_from_another_site_is_rejected_even_with_the_token(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    job_id = dead_job(app, jobs)
    response = _post_from(client, "https://evil.example", f"/jobs/{job_id}/replay")
    assert response.status_code == 403
    assert app.get_job(job_id).state.value == "dead"


def test_a_proxy_rewriting_host_gets_a_page_naming_origin_host_and_the_fix(
    app: errands.App, jobs: dict[str, Any], make_client: Callable[..., TestClient]
) -> None:
    """Behind a proxy that rewrites Host (nginx's default), Origin never matched Host and
    every action said "this form is stale... reload", which reloading never fixed. The
    page names both headers and the proxy fix; allowed_origins= lets that origin in."""
    job_id = dead_job(app, jobs)
    public = "https://jobs.example.com"
    refused = _post_from(make_client(), public, f"/jobs/{job_id}/replay")
    assert refused.status_code == 403
    text = unescape(refused.text)
    assert "stale" not in text
    assert f"'{public}' (its Origin header)" in text
    assert "'127.0.0.1:8080' (its Host header)" in text
    assert "proxy_set_header Host $host;" in text and "allowed_origins" in text
    assert app.get_job(job_id).state.value == "dead"

    behind_proxy = make_client(allowed_origins=[public])
    done = _post_from(behind_proxy, public, f"/jobs/{job_id}/replay")
    assert done.status_code == 303, done.text
    assert app.get_job(job_id).state.value == "available"
    evil = _post_from(behind_proxy, "https://evil.example", f"/jobs/{job_id}/cancel")
    assert evil.status_code == 403
    assert app.get_job(job_id).state.value == "available"


@pytest.mark.parametrize("origin", ["", "https://a.example/path", "https://u@a.example"])
def test_allowed_origins_refuses_what_is_not_an_origin(app: errands.App, origin: str) -> None:
    with pytest.raises(ConfigurationError, match="is not an origin"):
        create_app(app, password=PASSWORD, allowed_origins=[origin])


def test_login_needs_the_right_secret_and_its_own_csrf_token(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(signed_in=False)
    token = csrf_of(client.get("/login").text)
    wrong = client.post("/login", data={"csrf_token": token, "secret": "guess", "user": "eve"})
    assert wrong.status_code == 400 and "Wrong password or token" in wrong.text
    forged = client.post("/login", data={"csrf_token": "x", "secret": TOKEN})
    assert forged.status_code == 403
    assert client.get("/", follow_redirects=False).status_code == 303
    ok = client.post(
        "/login",
        data={"csrf_token": token, "secret": TOKEN, "user": "bob", "next": "/dlq"},
        follow_redirects=False,
    )
    assert ok.status_code == 303 and ok.headers["location"] == "/dlq"
    assert ">bob<" in client.get("/").text


def test_login_never_redirects_off_site(make_client: Callable[..., TestClient]) -> None:
    client = make_client(signed_in=False)
    token = csrf_of(client.get("/login").text)
    for target in ("//evil.example/", "https://evil.example/", "/\\evil.example"):
        client.cookies.clear()
        token = csrf_of(client.get("/login").text)
        response = client.post(
            "/login",
            data={"csrf_token": token, "secret": TOKEN, "next": target},
            follow_redirects=False,
        )
        assert response.headers["location"] == "/"


def test_repeated_wrong_logins_are_throttled(make_client: Callable[..., TestClient]) -> None:
    client = make_client(signed_in=False)
    token = csrf_of(client.get("/login").text)
    codes = [
        client.post("/login", data={"csrf_token": token, "secret": f"guess{i}"}).status_code
        for i in range(11)
    ]
    assert codes[:10] == [400] * 10 and codes[10] == 429
    right = client.post("/login", data={"csrf_token": token, "secret": TOKEN})
    assert right.status_code == 429  # even the right one, until the window passes


def same_address(client: TestClient) -> TestClient:
    """Another browser on the same dashboard, from the same address (as behind a proxy)."""
    return TestClient(client.app, base_url=BASE_URL, client=("127.0.0.1", 50001))


def failed_logins(client: TestClient, names: list[str]) -> list[int]:
    """One wrong login per name; their status codes."""
    token = csrf_of(client.get("/login").text)
    return [
        client.post(
            "/login", data={"csrf_token": token, "secret": "guess", "user": name}
        ).status_code
        for name in names
    ]


def test_wrong_logins_under_one_name_do_not_lock_out_others_behind_the_same_proxy(
    make_client: Callable[..., TestClient],
) -> None:
    attacker = make_client(signed_in=False)  # every client here connects from 127.0.0.1
    codes = failed_logins(attacker, ["alice"] * 12)
    bob = login(same_address(attacker), user="bob")  # another name
    assert bob.get("/", follow_redirects=False).status_code == 200
    assert codes[:10] == [400] * 10 and codes[10:] == [429, 429]
    locked = attacker.post(
        "/login",
        data={"csrf_token": csrf_of(attacker.get("/login").text), "secret": TOKEN, "user": "alice"},
    )
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) > 0


@dataclass
class FakeTime:
    """The login page's throttling waits, recorded and passed on this clock instead of
    slept (a throttle reads it once given ``clock``)."""

    now: float = 1000.0
    waits: list[float] = field(default_factory=list)
    frozen: bool = False  # True: the waits pass no time (attempts sent at once)

    def clock(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    time = FakeTime()

    async def sleep(seconds: float) -> None:
        time.waits.append(seconds)
        if not time.frozen:
            time.now += seconds

    monkeypatch.setattr(actions, "sleep", sleep)
    return time


@pytest.fixture
def waits(fake_time: FakeTime) -> list[float]:
    return fake_time.waits


def test_many_failed_logins_slow_every_login_down_but_lock_nobody_out(
    make_client: Callable[..., TestClient], fake_time: FakeTime, waits: list[float]
) -> None:
    attacker = make_client(signed_in=False)
    throttle = attacker.app.state.errands.auth.throttle  # type: ignore[attr-defined]
    throttle.free_failures, throttle.step, throttle.max_delay = 5, 0.5, 1.5
    throttle.clock = fake_time.clock
    codes = failed_logins(attacker, [f"name{i}" for i in range(10)])  # a new name each time
    assert codes == [400] * 10  # no name is locked ...
    assert waits == [0.5, 1.0, 1.5, 1.5]  # ... but past 5 failures every attempt waits
    waits.clear()
    login(same_address(attacker), user="carol")  # the right secret still gets in ...
    assert waits == [1.5]  # ... after the same bounded wait


def test_login_attempts_sent_at_once_past_the_free_failures_are_checked_in_turn(
    make_client: Callable[..., TestClient], fake_time: FakeTime
) -> None:
    """Past the free failures the secrets are checked one at a time, a delay apart: a
    guesser sending attempts at once, a new name each, waits in line, and once its
    address holds ``turns_per_address`` turns its further attempts are refused unchecked
    (429), the right secret too. A wait alone gave each of them a check per wait."""
    fake_time.frozen = True  # nothing the attempts wait passes: all are sent at once
    attacker = make_client(signed_in=False)
    throttle = attacker.app.state.errands.auth.throttle  # type: ignore[attr-defined]
    throttle.free_failures, throttle.step, throttle.max_delay = 5, 0.5, 1.5
    throttle.clock = fake_time.clock
    codes = failed_logins(attacker, [f"name{i}" for i in range(12)])
    assert codes == [400] * 10 + [429] * 2  # 6 free, then the address's 4 turns
    # each turn a delay (0.5, 1.0, then 1.5 s) after the one before: one check at a time
    assert fake_time.waits == [0.5, 1.0, 2.0, 3.5]
    right = attacker.post(
        "/login", data={"csrf_token": csrf_of(attacker.get("/login").text), "secret": TOKEN}
    )
    assert right.status_code == 429 and int(right.headers["retry-after"]) > 0
    fake_time.now += 2.0  # the line has moved on: a turn for the address again
    assert login(same_address(attacker), user="carol").get("/").status_code == 200


def test_a_flood_of_logins_from_one_address_leaves_a_turn_to_another(
    make_client: Callable[..., TestClient], fake_time: FakeTime
) -> None:
    """At most ``turns_per_address`` pending turns per address: attempts sent at once
    from one address, a new name each, take that many, and an operator elsewhere logs
    in behind them (the flood took every turn, and every login got 429 while it lasted)."""
    fake_time.frozen = True
    attacker = make_client(signed_in=False)
    throttle = attacker.app.state.errands.auth.throttle  # type: ignore[attr-defined]
    throttle.free_failures, throttle.step, throttle.max_delay = 5, 0.5, 1.5
    throttle.clock = fake_time.clock
    codes = failed_logins(attacker, [f"name{i}" for i in range(20)])
    assert codes.count(400) == 6 + throttle.turns_per_address
    operator = TestClient(attacker.app, base_url=BASE_URL, client=("10.0.0.2", 50002))
    assert login(operator, user="carol").get("/").status_code == 200
    assert max(fake_time.waits) <= throttle.max_waiting * throttle.max_delay


def wrong_logins_at_once(client: TestClient, name: str, count: int) -> list[int]:
    """``count`` wrong logins under one name, all sent before any is answered."""
    return failed_logins(client, [name] * count)


def test_a_guesser_of_one_name_behind_a_proxy_does_not_lock_out_another_name(
    make_client: Callable[..., TestClient], fake_time: FakeTime
) -> None:
    """The turns were one per address: behind a proxy (one address for all) a guesser
    re-sending wrong logins under one name held the proxy's turn, and every operator's
    right login got 429 (1000 of 1000 in the review). A turn is now per address and name:
    bob gets the one after alice's guesser, while the guesser still gets one check at a
    time and is locked after ``max_failures``. At the longest delay, too: there a turn
    ``max_delay`` away fitted only the first in line."""
    attacker = make_client(signed_in=False)  # every client here connects from 127.0.0.1
    throttle = attacker.app.state.errands.auth.throttle  # type: ignore[attr-defined]
    throttle.free_failures, throttle.step, throttle.max_delay = 5, 0.5, 1.5
    throttle.clock = fake_time.clock
    for i in range(20):  # other failures (elsewhere) hold the delay at its longest
        throttle.failed(("10.0.0.9", f"name{i}"))
    assert throttle.delay() == throttle.max_delay
    guesses: list[list[int]] = []
    for _ in range(throttle.max_failures + 2):
        fake_time.frozen = True  # the guesser's attempts are all in flight together
        guesses.append(wrong_logins_at_once(attacker, "alice", 4))
        fake_time.frozen = False  # bob's wait passes (the guesser's turn with it)
        fake_time.waits.clear()
        login(same_address(attacker), secret=TOKEN, user="bob")  # 303, never 429
        assert fake_time.waits and max(fake_time.waits) <= 2 * throttle.max_delay
    checked = [g for g in guesses if 400 in g]
    assert all(g == [400, 429, 429, 429] for g in checked)  # one check at a time ...
    assert len(checked) == throttle.max_failures  # ... and then the name is locked
    assert guesses[-1] == [429] * 4
    assert throttle.retry_after(("127.0.0.1", "alice")) > 0


def test_the_login_line_past_the_longest_delay_holds_at_most_max_waiting_turns(
    make_client: Callable[..., TestClient], fake_time: FakeTime
) -> None:
    """A turn further away than ``max_delay`` is given only while fewer than
    ``max_waiting`` wait, so that the attempts sleeping for their turn stay few and none
    waits longer than ``max_waiting * max_delay``."""
    fake_time.frozen = True
    first = make_client(signed_in=False)
    throttle = first.app.state.errands.auth.throttle  # type: ignore[attr-defined]
    throttle.free_failures, throttle.step, throttle.max_delay = 5, 0.5, 1.5
    throttle.clock = fake_time.clock
    for i in range(20):
        throttle.failed(("10.0.0.9", f"name{i}"))
    codes: list[int] = []
    for n in range(4):  # four addresses, four names each: more than the line holds
        client = TestClient(first.app, base_url=BASE_URL, client=(f"10.0.1.{n}", 50000))
        codes += failed_logins(client, [f"user{i}" for i in range(4)])
    assert codes.count(400) == throttle.max_waiting and codes.count(429) == 16 - 8
    assert max(fake_time.waits) <= throttle.max_waiting * throttle.max_delay


def test_the_failed_login_table_forgets_old_entries_and_stays_bounded(
    make_client: Callable[..., TestClient], fake_time: FakeTime, waits: list[float]
) -> None:
    client = make_client(signed_in=False)
    throttle = client.app.state.errands.auth.throttle  # type: ignore[attr-defined]
    throttle.clock = fake_time.clock
    failed_logins(client, [f"name{i}" for i in range(20)])
    assert len(throttle) == 20
    fake_time.now += throttle.window + 1
    failed_logins(client, ["late"])
    assert len(throttle) == 1 and throttle.delay() == 0
    throttle.max_keys = 5
    failed_logins(client, [f"other{i}" for i in range(8)])
    assert len(throttle) == 5
    throttle.free_failures, throttle.step, throttle.max_delay = 2, 1.0, 3.0
    failed_logins(client, [f"more{i}" for i in range(100)])
    assert len(throttle._recent) <= 2 + 3  # past the maximum delay, no more are counted
    assert max(waits) == 3.0


def test_a_tampered_session_cookie_signs_nobody_in(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    cookie = client.cookies["errands_dashboard"]
    client.cookies.clear()
    client.cookies.set(
        "errands_dashboard", cookie[:-6] + ("A" * 6 if cookie[-1] != "A" else "B" * 6)
    )
    assert client.get("/", follow_redirects=False).status_code == 303
    client.cookies.clear()
    client.cookies.set("errands_dashboard", cookie)  # the untouched cookie still works
    assert client.get("/", follow_redirects=False).status_code == 200
    payload, _, rest = cookie.partition(".")
    client.cookies.clear()  # a forged payload ("I am admin") with the old signature
    client.cookies.set("errands_dashboard", payload[:-2] + "xx." + rest)
    assert client.get("/", follow_redirects=False).status_code == 303


def test_session_cookie_is_httponly_and_samesite(make_client: Callable[..., TestClient]) -> None:
    client = make_client(signed_in=False)
    token = csrf_of(client.get("/login").text)
    response = client.post(
        "/login", data={"csrf_token": token, "secret": TOKEN}, follow_redirects=False
    )
    cookie = response.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=lax" in cookie


def test_sign_out_ends_the_session(client: TestClient) -> None:
    response = post(client, "/logout")
    assert response.status_code == 303 and response.headers["location"] == "/login"
    assert client.get("/", follow_redirects=False).status_code == 303


def test_a_read_only_viewer_sees_no_action_and_every_action_is_refused(
    app: errands.App, jobs: dict[str, Any], make_client: Callable[..., TestClient]
) -> None:
    job_id = dead_job(app, jobs)
    client = make_client(authorize=lambda request: "read")
    detail = client.get(f"/jobs/{job_id}").text
    assert "read-only" in detail and ">Replay<" not in detail and ">Discard<" not in detail
    assert "Replay…" not in client.get("/dlq").text
    for path, data in ACTIONS[:-1]:
        response = post(client, path.replace("/1/", f"/{job_id}/"), {**data, "ids": str(job_id)})
        assert response.status_code == 403, path
        assert "read-only" in response.text
    assert app.get_job(job_id).state.value == "dead"
    assert app.audit() == []


def test_per_action_rights_allow_only_the_named_actions(
    app: errands.App, jobs: dict[str, Any], make_client: Callable[..., TestClient]
) -> None:
    first, second = dead_job(app, jobs), dead_job(app, jobs)
    client = make_client(authorize=lambda request: {"replay"})
    page = client.get(f"/jobs/{first}").text
    assert ">Replay<" in page and ">Discard<" not in page
    assert post(client, f"/jobs/{second}/discard", {"reason": "x"}).status_code == 403
    assert post(client, f"/jobs/{first}/replay").status_code == 303
    assert app.get_job(first).state.value == "available"
    assert app.get_job(second).state.value == "dead"


def admins_only(request: Any) -> str:
    """An ``authorize`` that trusts ``request.state.user`` for per-user rights."""
    return "all" if request.state.user in ("admin", "root") else "read"


@pytest.mark.parametrize("typed", ["admin", "root", "alice", ""])
def test_a_name_typed_at_a_shared_secret_login_grants_no_rights(
    app: errands.App, jobs: dict[str, Any], make_client: Callable[..., TestClient], typed: str
) -> None:
    job_id = dead_job(app, jobs)
    client = make_client(user=typed, authorize=admins_only)
    assert "read-only" in client.get("/").text
    response = post(client, f"/jobs/{job_id}/replay")
    assert response.status_code == 403
    assert app.get_job(job_id).state.value == "dead"
    assert app.audit() == []


def test_authorize_tells_a_typed_label_from_an_authenticated_user(
    app: errands.App, make_client: Callable[..., TestClient]
) -> None:
    seen: list[Any] = []

    def authorize(request: Any) -> str:
        seen.append((request.state.user, request.state.identity))
        return "read"

    make_client(user="admin", authorize=authorize).get("/")
    typed_user, typed = seen[-1]
    assert typed_user is None and typed.user is None and not typed.verified
    assert (typed.label, typed.method) == ("admin", "password")
    vouched = create_app(app, user=lambda request: "carol", authorize=authorize)
    TestClient(vouched, base_url="https://shop.example").get("/")
    user, identity = seen[-1]
    assert user == identity.user == identity.label == "carol"
    assert identity.verified and identity.method == "user"


def test_per_user_rights_come_from_the_user_resolver(
    app: errands.App, jobs: dict[str, Any]
) -> None:
    job_id = dead_job(app, jobs)
    dashboard = create_app(
        app, user=lambda request: request.scope.get("login"), authorize=admins_only
    )

    def as_user(name: str) -> TestClient:
        async def signed_in(scope: Any, receive: Any, send: Any) -> None:
            await dashboard({**scope, "login": name}, receive, send)

        return TestClient(signed_in, base_url="https://shop.example")

    alice = as_user("alice").get(f"/jobs/{job_id}").text
    assert "read-only" in alice and ">Replay<" not in alice
    root = as_user("root")
    assert ">Replay<" in root.get(f"/jobs/{job_id}").text
    assert post(root, f"/jobs/{job_id}/replay", page=f"/jobs/{job_id}").status_code == 303
    assert [e.actor for e in app.audit(job_id=job_id)] == ["dashboard:root"]


@pytest.mark.parametrize(
    ("secret", "typed", "actor"),
    [
        (PASSWORD, "alice", "dashboard:alice (shared password)"),
        (TOKEN, "bob", "dashboard:bob (shared token)"),
        (TOKEN, "", "dashboard:unnamed (shared token)"),
    ],
)
def test_the_audit_log_says_how_a_shared_secret_user_signed_in(
    app: errands.App,
    jobs: dict[str, Any],
    make_client: Callable[..., TestClient],
    secret: str,
    typed: str,
    actor: str,
) -> None:
    job_id = dead_job(app, jobs)
    client = login(make_client(signed_in=False), secret=secret, user=typed)
    assert post(client, f"/jobs/{job_id}/replay").status_code == 303
    assert [e.actor for e in app.audit(job_id=job_id)] == [actor]
    assert f'title="actions are audited as {actor}"' in client.get("/").text


def test_the_audit_log_says_a_loopback_user_had_no_login(
    app: errands.App, jobs: dict[str, Any]
) -> None:
    job_id = dead_job(app, jobs)
    local = TestClient(create_app(app), base_url=BASE_URL, client=("127.0.0.1", 1))
    assert post(local, f"/jobs/{job_id}/replay", page=f"/jobs/{job_id}").status_code == 303
    assert [e.actor for e in app.audit(job_id=job_id)] == ["dashboard:local (loopback, no login)"]


def test_a_trusted_proxy_header_names_the_user_only_on_the_proxys_connection(
    app: errands.App,
) -> None:
    resolver = header_user("X-Auth-User", trusted=["10.0.0.0/24"])
    dashboard = create_app(app, user=resolver, authorize=admins_only)
    proxy = TestClient(dashboard, base_url="https://shop.example", client=("10.0.0.7", 1))
    assert proxy.get("/").status_code == 401
    page = proxy.get("/", headers={"x-auth-user": "root"})
    assert page.status_code == 200 and "read-only" not in page.text
    direct = TestClient(dashboard, base_url="https://shop.example", client=("203.0.113.9", 1))
    assert direct.get("/", headers={"x-auth-user": "root"}).status_code == 401
    with pytest.raises(ConfigurationError, match="trusted"):
        header_user("X-Auth-User", trusted=[])
    with pytest.raises(ConfigurationError, match="not an address"):
        header_user("X-Auth-User", trusted=["proxy.example"])


@pytest.mark.parametrize(
    ("granted", "says"),
    [
        ({"replay", "nuke"}, "unknown action(s) ['nuke']"),
        ("superuser", "returned 'superuser'"),
        (iter(["replay"]), "returned a list_iterator"),  # only a set, list or tuple of names
        ([1, 2], "returned a list holding a int"),
    ],
)
def test_authorize_granting_something_unknown_is_a_clear_error_and_denies(
    app: errands.App, caplog: pytest.LogCaptureFixture, granted: Any, says: str
) -> None:
    client = TestClient(
        create_app(app, authorize=lambda r: granted),
        base_url=BASE_URL,
        client=("127.0.0.1", 1),
        raise_server_exceptions=True,
    )
    response = client.get("/")
    assert response.status_code == 500 and says in unescape(response.text)
    assert any(says in r.getMessage() for r in caplog.records)


def test_the_host_applications_login_names_the_user_when_mounted(
    app: errands.App, jobs: dict[str, Any]
) -> None:
    job_id = dead_job(app, jobs)
    dashboard = create_app(app, user=lambda request: request.headers.get("x-user"))
    host = Starlette(routes=[Mount("/admin/jobs", app=dashboard)])
    client = TestClient(host, base_url="https://shop.example")
    assert client.get("/admin/jobs/").status_code == 401
    page = client.get(f"/admin/jobs/jobs/{job_id}", headers={"x-user": "carol"})
    assert page.status_code == 200
    assert f'action="/admin/jobs/jobs/{job_id}/replay"' in page.text  # links keep the mount
    replay = client.post(
        f"/admin/jobs/jobs/{job_id}/replay",
        data={"csrf_token": csrf_of(page.text)},
        headers={"x-user": "carol"},
        follow_redirects=False,
    )
    assert replay.status_code == 303
    assert replay.headers["location"] == f"/admin/jobs/jobs/{job_id}"
    [event] = app.audit(job_id=job_id)
    assert (event.action, event.actor) == ("replay", "dashboard:carol")


def test_without_a_login_only_loopback_clients_and_hosts_are_served(app: errands.App) -> None:
    dashboard = create_app(app)
    local = TestClient(dashboard, base_url="http://127.0.0.1:8080", client=("127.0.0.1", 1))
    assert local.get("/").status_code == 200
    assert ">local<" in local.get("/").text
    remote = TestClient(dashboard, base_url="http://127.0.0.1:8080", client=("10.1.2.3", 1))
    assert remote.get("/").status_code == 403
    rebound = TestClient(dashboard, base_url="http://attacker.example", client=("127.0.0.1", 1))
    response = rebound.get("/")
    assert response.status_code == 403 and "ERRANDS_DASHBOARD_PASSWORD" in response.text


def test_an_xss_payload_in_job_data_is_rendered_escaped(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    handle = jobs["charge"].enqueue(order_id=1, note=XSS, key=XSS)
    finish_due(app, "payments", "dead", message=XSS)
    pages = [
        client.get("/jobs").text,
        client.get(f"/jobs/{handle.id}").text,
        client.get("/dlq").text,
        client.get("/jobs", params={"q": XSS}).text,
        client.get("/jobs", params={"queue": XSS}).text,
    ]
    for html in pages:
        assert "<script>alert(" not in html
    assert "&lt;script&gt;alert(" in pages[1] and "&lt;script&gt;alert(" in pages[2]
    assert "&lt;script&gt;alert(" in pages[3]  # the search found it by key, escaped


def test_sensitive_arguments_are_masked_everywhere(
    app: errands.App, jobs: dict[str, Any], client: TestClient
) -> None:
    job_id = dead_job(app, jobs)
    for path in ("/jobs", f"/jobs/{job_id}", "/dlq", "/jobs?state=dead"):
        html = client.get(path).text
        assert EMAIL not in html, path
        assert "***" in html, path


def test_every_response_carries_the_security_headers(client: TestClient) -> None:
    response = client.get("/")
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["cache-control"] == "no-store"


def test_htmx_is_served_from_the_package_and_nothing_from_elsewhere(client: TestClient) -> None:
    html = client.get("/").text
    assert 'src="/static/htmx.min.js' in html
    assert "https://" not in html and "http://" not in html.replace("http://www.w3.org", "")
    script = client.get("/static/htmx.min.js")
    assert script.status_code == 200 and "htmx" in script.text[:200]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_addresses_may_be_served_without_a_login(host: str) -> None:
    assert is_loopback_host(host)
    refuse_open_bind(host, AuthConfig())


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "192.168.1.10"])
def test_other_addresses_are_refused_without_a_login(host: str) -> None:
    with pytest.raises(ConfigurationError, match="refusing"):
        refuse_open_bind(host, AuthConfig())
    refuse_open_bind(host, AuthConfig(password="pw"))  # with a login they are fine


def test_the_cli_refuses_a_public_address_without_a_login(app: errands.App) -> None:
    app.migrate()
    result = CliRunner().invoke(
        cli, ["dashboard", "--url", app.url, "--host", "0.0.0.0", "--port", "1"], env={}
    )
    assert result.exit_code == 1
    assert "refusing to serve the dashboard on '0.0.0.0' without a login" in result.output


@pytest.mark.parametrize(
    "header",
    [
        ("forwarded", "for=203.0.113.9;proto=https"),
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-host", "jobs.example"),
        ("x-forwarded-proto", "https"),
        ("x-real-ip", "203.0.113.9"),
    ],
)
def test_without_a_login_a_request_forwarded_by_a_local_proxy_is_refused(
    app: errands.App, jobs: dict[str, Any], header: tuple[str, str]
) -> None:
    job_id = dead_job(app, jobs)
    local = TestClient(create_app(app), base_url=BASE_URL, client=("127.0.0.1", 1))
    page = local.get(f"/jobs/{job_id}")
    assert page.status_code == 200  # a direct request from this machine is still served
    token = csrf_of(page.text)
    refused = local.get(f"/jobs/{job_id}", headers=dict([header]))
    assert refused.status_code == 403
    assert "proxy" in refused.text and "ERRANDS_DASHBOARD_PASSWORD" in refused.text
    replay = local.post(
        f"/jobs/{job_id}/replay",
        data={"csrf_token": token},
        headers=dict([header]),
        follow_redirects=False,
    )
    assert replay.status_code == 403
    assert app.get_job(job_id).state.value == "dead"
