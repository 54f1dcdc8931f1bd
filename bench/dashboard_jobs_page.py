"""Server time of the dashboard's jobs page over 1,000,000 jobs on PostgreSQL.

    .venv/bin/python bench/dashboard_jobs_page.py [--url postgresql://postgres@127.0.0.1/errands_test]
                                                  [--rows 1000000] [--repeat 15] [--keep]

Loads the rows into a fresh schema with one ``INSERT ... SELECT FROM generate_series``
(a realistic mix: mostly completed, some pending, dead and retrying, a few rare job names,
idempotency keys on a third), then times the dashboard's pages in-process: the time from
the ASGI request to the end of the response body, measured around the dashboard app, so
no client or network time is counted. Prints median and worst of ``--repeat`` requests per
page (after one warm-up request each) and the plan of each jobs-page query. Target: under
300 ms. Not a test: run it by hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import psycopg
from starlette.testclient import TestClient

import errands
from errands.backends.base import ListParams
from errands.backends.shared_admin import listing_query, listing_values
from errands.dashboard import create_app

URL_DEFAULT = os.environ.get(
    "ERRANDS_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/errands_test"
)
SCHEMA = "bench_dashboard"
TARGET_MS = 300.0

# 14 job names over 6 queues; the last two are rare (about 1 in 20,000 rows)
LOAD_SQL = """
INSERT INTO {schema}.errands_jobs
    (name, queue, args, meta, state, priority, attempt, max_attempts, run_at, idempotency_key,
     errors, result, inserted_at, attempted_at, finished_at)
SELECT name, queue,
       jsonb_build_object('order_id', g, 'email', 'user' || g || '@example.com'),
       '{{"sensitive": ["email"]}}'::jsonb,
       state, 0,
       CASE WHEN state IN ('dead', 'retryable') THEN 3 ELSE 1 END, 4,
       CASE WHEN state = 'scheduled' THEN now() + interval '1 hour' ELSE at END,
       CASE WHEN g %% 3 = 0 THEN 'order:' || g END,
       CASE WHEN state IN ('dead', 'retryable') THEN jsonb_build_array(jsonb_build_object(
            'at', extract(epoch FROM at), 'attempt', 1, 'type', 'ConnectionError',
            'message', 'connection refused', 'traceback', null, 'worker', 'w-1',
            'kind', 'transient'))
            ELSE '[]'::jsonb END,
       CASE WHEN state = 'completed' THEN '"ok"'::jsonb END,
       at - interval '2 seconds',
       CASE WHEN state NOT IN ('available', 'scheduled') THEN at - interval '1 second' END,
       CASE WHEN state IN ('completed', 'dead', 'discarded', 'cancelled') THEN at END
FROM (
    SELECT g,
           now() - make_interval(secs => (%(rows)s - g) * 604800.0 / %(rows)s) AS at,
           CASE WHEN g %% 20011 = 0 THEN 'reports.rare_audit'
                WHEN g %% 20021 = 0 THEN 'billing.rare_refund'
                ELSE (ARRAY['emails.send_welcome', 'emails.send_receipt', 'emails.digest',
                            'webhooks.deliver', 'webhooks.retry_failed', 'billing.charge',
                            'billing.invoice', 'imports.csv', 'imports.xlsx', 'search.reindex',
                            'search.warm_cache', 'thumbnails.make'])[1 + g %% 12] END AS name,
           (ARRAY['emails', 'emails', 'webhooks', 'webhooks', 'billing', 'billing',
                  'imports', 'imports', 'search', 'search', 'media', 'media'])[1 + g %% 12]
               AS queue,
           CASE WHEN g > %(rows)s - 2000 AND g %% 4 = 0 THEN 'available'
                WHEN g > %(rows)s - 200 AND g %% 4 = 1 THEN 'running'
                WHEN g %% 997 = 0 THEN 'dead'
                WHEN g %% 1499 = 0 THEN 'retryable'
                WHEN g %% 1999 = 0 THEN 'scheduled'
                WHEN g %% 3001 = 0 THEN 'discarded'
                WHEN g %% 5003 = 0 THEN 'cancelled'
                ELSE 'completed' END AS state
    FROM generate_series(1, %(rows)s) AS g
) AS src
"""


def load(url: str, rows: int) -> errands.App:
    base = url.split("?")[0]
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
    app = errands.App(f"{base}?schema={SCHEMA}")
    app.migrate()
    started = time.perf_counter()
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(LOAD_SQL.format(schema=f'"{SCHEMA}"'), {"rows": rows})  # type: ignore[arg-type]
        conn.execute(f'VACUUM ANALYZE "{SCHEMA}".errands_jobs')
    print(f"loaded {rows:,} jobs in {time.perf_counter() - started:.1f} s (with VACUUM ANALYZE)")
    return app


class Timed:
    """Wraps an ASGI app and records each request's time until its body is sent."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.last_ms = 0.0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = time.perf_counter()
        await self.app(scope, receive, send)
        self.last_ms = (time.perf_counter() - started) * 1000


def explain(app: errands.App, params: dict[str, Any]) -> str:
    backend: Any = app.backend
    listing = ListParams(**{"limit": 51, **params})  # the statement the dashboard runs
    query, full = backend.q[listing_query(listing)], listing_values(listing)
    with backend._conn() as conn:
        plan = conn.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + query, full).fetchall()
    lines = [r[0] for r in plan]
    nodes = [ln.strip().lstrip("-> ").split("  ")[0] for ln in lines if "Scan" in ln]
    total = next((ln for ln in lines if ln.startswith("Execution Time")), "")
    return "; ".join(nodes[:3]) + f" ({total.replace('Execution Time: ', '')})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=URL_DEFAULT)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--keep", action="store_true", help="keep the schema afterwards")
    parser.add_argument("--reuse", action="store_true", help="time a schema kept by --keep")
    args = parser.parse_args()
    if args.reuse:
        app = errands.App(f"{args.url.split('?')[0]}?schema={SCHEMA}")
    else:
        app = load(args.url, args.rows)
    newest = app.jobs(limit=1)[0].id
    deep = newest - int(args.rows * 0.9)  # 90 % of the way down the table
    some_key = f"order:{(args.rows // 2) // 3 * 3}"
    timed = Timed(create_app(app, password="bench", refresh_seconds=0))
    pages = [
        ("first page", "/jobs", {}),
        ("state=dead", "/jobs?state=dead", {"state": "dead"}),
        ("state=available&queue=emails", "/jobs?state=available&queue=emails",
         {"state": "available", "queue": "emails"}),
        ("queue=billing", "/jobs?queue=billing", {"queue": "billing"}),
        ("name=billing.charge", "/jobs?name=billing.charge", {"name": "billing.charge"}),
        ("name=reports.rare_audit (rare)", "/jobs?name=reports.rare_audit",
         {"name": "reports.rare_audit"}),
        ("deep keyset page", f"/jobs?before_id={deep}", {"before_id": deep}),
        ("deep keyset, state=dead", f"/jobs?state=dead&before_id={deep}",
         {"state": "dead", "before_id": deep}),
        ("deep keyset, name=billing.charge", f"/jobs?name=billing.charge&before_id={deep}",
         {"name": "billing.charge", "before_id": deep}),
        ("search by key", f"/jobs?q={some_key}", None),
        ("search by id", f"/jobs?q={deep}", None),
        ("dead-letter queue", "/dlq", None),
        ("overview (for reference)", "/", None),
    ]  # fmt: skip
    worst_overall = 0.0
    with TestClient(timed, base_url="http://127.0.0.1", client=("127.0.0.1", 1)) as client:
        page = client.get("/login")
        token = page.text.split('name="csrf_token" value="')[1].split('"')[0]
        client.post("/login", data={"csrf_token": token, "secret": "bench"})
        print(f"\n{'page':40} {'median':>9} {'worst':>9}   plan of the jobs query")
        for label, path, params in pages:
            client.get(path)  # warm-up
            samples = []
            for _ in range(args.repeat):
                response = client.get(path)
                assert response.status_code == 200, (path, response.status_code)
                samples.append(timed.last_ms)
            median, worst = statistics.median(samples), max(samples)
            if label != "overview (for reference)":
                worst_overall = max(worst_overall, median)
            plan = explain(app, params) if params is not None else ""
            print(f"{label:40} {median:7.1f}ms {worst:7.1f}ms   {plan}")
    verdict = "PASS" if worst_overall < TARGET_MS else "FAIL"
    target = f"target < {TARGET_MS:.0f} ms"
    print(f"\nslowest jobs-page median: {worst_overall:.1f} ms ({target}): {verdict}")
    app.close()
    if not args.keep:
        with psycopg.connect(args.url.split("?")[0], autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
