"""The dashboard re-checked on the soak's final store (issue 10, item 4).

After the chaos, on the 100,000 jobs the run left behind, the dashboard must still: send a
signed-out visitor to the login page, refuse every action without a session, without
the CSRF token or from another site (the job stays as it was), render the markup a
failing job put in its error message escaped, and mask sensitive arguments (the payment
amounts) in the arguments, results and steps it shows.
"""

from __future__ import annotations

import html
from typing import Any

import errands
from tests.dashboard.helpers import BASE_URL, csrf_of, login

from .checker import Findings

SECRET = "soak-dashboard-secret"
PAGES = ("/", "/jobs", "/dlq", "/queues", "/workers")
MARKUP = "<script>alert("  # what soak.doomed puts in its error message


def recheck(out: Findings, app: errands.App) -> None:
    from starlette.testclient import TestClient

    from errands.dashboard import create_app

    doomed = app.jobs(state="dead", name="soak.doomed", limit=1)
    paid = app.jobs(state="completed", name="soak.pay", limit=1)
    if not doomed or not paid:
        out.fail("dashboard", "no dead soak.doomed or completed soak.pay job to check with")
        return
    dead, pay = doomed[0], paid[0]
    checked: list[str] = []
    with TestClient(create_app(app, password=SECRET), base_url=BASE_URL) as client:
        for path in PAGES:  # signed out: every page sends the visitor to the login page
            response = client.get(path, follow_redirects=False)
            if response.status_code not in (302, 303, 307) or "/login" not in response.headers.get(
                "location", ""
            ):
                out.fail("dashboard", f"signed out, GET {path} answered {response.status_code}")
        checked.append(f"sign-in required on {len(PAGES)} pages")
        action = f"/jobs/{dead.id}/replay"
        token = csrf_of(client.get("/login").text)
        _refused(out, client, action, {"csrf_token": token}, {}, 401, "without a session")
        login(client, secret=SECRET)
        _refused(out, client, action, {}, {}, 403, "without the CSRF token")
        token = csrf_of(client.get("/").text)
        evil = {"origin": "https://evil.example"}
        _refused(out, client, action, {"csrf_token": token}, evil, 403, "from another site")
        if app.get_job(dead.id).state.value != "dead":
            out.fail("dashboard", f"a refused replay changed job {dead.id}")
        checked.append("replay refused without a session, without CSRF, cross-site")
        page = client.get(f"/jobs/{dead.id}").text
        if MARKUP in page or html.escape(MARKUP, quote=False) not in page:
            out.fail("dashboard", f"job {dead.id}: its error's markup is not shown escaped")
        checked.append("error markup escaped")
        page = client.get(f"/jobs/{pay.id}").text
        amount = str(pay.args.get("amount"))
        shown = [t for t in (f"&#34;amount&#34;: {amount}", f'"amount": {amount}') if t in page]
        if shown or "***" not in page:
            out.fail("dashboard", f"job {pay.id}: its sensitive amount {amount} is shown")
        checked.append("sensitive amounts masked in arguments, results and steps")
    out.figures["dashboard re-check"] = "; ".join(checked)


def _refused(
    out: Findings,
    client: Any,
    path: str,
    data: dict[str, str],
    headers: dict[str, str],
    expected: int,
    how: str,
) -> None:
    response = client.post(path, data=data, headers=headers, follow_redirects=False)
    if response.status_code != expected:
        out.fail("dashboard", f"POST {path} {how} answered {response.status_code}, not {expected}")
