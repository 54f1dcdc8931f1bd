"""Paging a queue's available jobs from the CLI and the API: by priority, then due time,
after a cursor the next-page line gives; a wrong paging option is refused with the one
that works."""

from __future__ import annotations

import json
import re

import pytest

import errands
from errands.errors import ConfigurationError

from .helpers import run_cli


def test_the_cli_pages_a_queues_available_jobs_by_priority_after_the_printed_cursor(
    store: errands.App,
) -> None:
    """``errands jobs list --state available --queue Q`` prints a full page and the
    ``--after`` that continues it; following it visits every available job once, highest
    priority first."""

    @store.job(name="shop.charge", queue="payments")
    def charge(order_id: int) -> None: ...

    low = store.enqueue_many([charge.bind(order_id=i) for i in range(3)])
    high = store.enqueue_many([charge.bind(order_id=i, priority=5) for i in range(2)])
    base = ["jobs", "list", "--url", store.url, "--state", "available", "--queue", "payments"]
    seen: list[int] = []
    args = [*base, "--limit", "2"]
    for _ in range(5):
        result = run_cli(*args, "--json")
        assert result.exit_code == 0, result.output
        listed = json.loads(result.output)
        seen += [j["id"] for j in listed]
        text = run_cli(*args).output
        found = re.search(r"next page: --after (\S+)", text)
        if found is None:
            break
        assert found.group(1) == listed[-1]["cursor"]  # the JSON carries it too
        args = [*base, "--limit", "2", "--after", found.group(1)]
    assert seen == [h.id for h in high] + [h.id for h in low]


def test_paging_options_that_do_not_fit_the_listing_are_refused_naming_the_one_that_does(
    store: errands.App,
) -> None:
    """``--before`` on a listing by priority, ``--after`` on a newest-first one, and a
    cursor that is not one: each a usage error (the CLI) or a ConfigurationError (the
    API) that names what to use."""
    store.migrate()
    by_priority = ["jobs", "list", "--url", store.url, "--state", "available", "--queue", "q"]
    before = run_cli(*by_priority, "--before", "10")
    assert before.exit_code == 2 and "page with --after" in before.output
    after = run_cli("jobs", "list", "--url", store.url, "--after", "0:0:1")
    assert after.exit_code == 2 and "other listings page with --before" in after.output
    for cursor in ("soon", "0:1e300:1", "9999999999:0:1", "0:0:99999999999999999999"):
        bad = run_cli(*by_priority, "--after", cursor)
        assert bad.exit_code == 2 and "PRIORITY:DUE_SECONDS:ID" in bad.output, cursor
    with pytest.raises(ConfigurationError, match="page them with after="):
        store.jobs(state="available", queue="q", before_id=10)
    with pytest.raises(ConfigurationError, match="page them with before_id"):
        store.jobs(state="dead", after="0:0:1")
