"""Database URLs (DESIGN §11), in process: every malformed URL is a ConfigurationError
that names the problem and never repeats the password; nothing else escapes. The real
command line gets a representative sample of these in test_bad_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import errands
from errands.backends import open_backend, redact_url, url_scheme
from errands.backends.postgres.config import parse_postgres_url
from errands.backends.sqlite.backend import parse_sqlite_url

from .support import PASSWORD, closed_port


def _parse(url: str) -> None:
    """What opening a URL checks before it touches any database."""
    scheme = url_scheme(url)
    if scheme == "sqlite":
        parse_sqlite_url(url)
    elif scheme in ("postgres", "postgresql"):
        parse_postgres_url(url)
    else:
        open_backend(url)


# A small alphabet (the URL syntax characters and a few others) keeps shrinking quick.
piece = st.text(st.sampled_from("ab1:@/?#[]%&=.;-_ é"), max_size=8) | st.sampled_from(
    ["[", "]", "@", ":", "%", "%zz", "::1", "localhost", "?", "#", "/", "//", "[::1"]
)
option = st.tuples(
    st.sampled_from(
        ["schema", "pool_size", "auto_migrate", "prepare", "notify_window", "listen",
         "synchronous", "busy_timeout_ms", "write_timeout", "sslmode", "password", "frob"]
    ),
    piece,
)  # fmt: skip
urls = st.builds(
    lambda scheme, sep, user, host, path, options: (
        f"{scheme}{sep}{user}:{PASSWORD}@{host}/{path}?" + "&".join(f"{k}={v}" for k, v in options)
    ),
    st.sampled_from(["sqlite", "postgresql", "postgres", "mysql", "SQLite", "file", "", "redis"]),
    st.sampled_from(["://", ":///", ":", "//", ""]),
    piece,
    piece,
    piece,
    st.lists(option, max_size=3),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(url=urls)
@example(url=f"sqlite:///1?:{PASSWORD}@/?schema=1")  # found by hypothesis: an option name
def test_any_malformed_url_is_a_configuration_error_that_never_shows_the_password(
    url: str,
) -> None:
    try:
        _parse(url)
    except errands.ConfigurationError as exc:
        assert PASSWORD not in str(exc), str(exc)
        assert "\n" not in str(exc)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite://", "names no file"),
        ("sqlite:///x.db?busy_timeout_ms=soon", "busy_timeout_ms must be a whole number"),
        ("sqlite:///x.db?write_timeout=never", "write_timeout a number of seconds"),
        ("sqlite:///x.db?journal_mode=off", "unknown option(s) journal_mode"),
        ("sqlite://[::1/x.db", "malformed database URL"),
        (f"postgresql://[:{PASSWORD}@]/db", "malformed database URL"),  # urlsplit quotes it
        (f"postgresql://u:{PASSWORD}@h/db?pool_size=1", "pool_size must be at least 2"),
        (f"postgresql://u:{PASSWORD}@h/db?notify_window=soon", "could not convert string"),
        (f"postgresql://u:{PASSWORD}@h/db?prepare=perhaps", "prepare='perhaps'"),
        (f"postgresql://u:{PASSWORD}@h/db?listen=2", "listen='2'"),
        (f"postgresql://u:{PASSWORD}@h/db?schema=Shop", "schema='Shop'"),
        (f"postgresql://u:{PASSWORD}@h/db?schema={'s' * 51}", "at most 50 characters"),
        (f"postgresql://u:{PASSWORD}@h/db?schema=a%22b", "schema='a\"b'"),
        (f"mssql://u:{PASSWORD}@h/db", "unsupported database URL 'mssql://u:***@h/db'"),
        (f"postgresql://u:{PASSWORD}@h:5432/db?password={PASSWORD}&pool_size=x", "***"),
    ],
)
def test_each_bad_url_option_names_the_option_and_how_to_fix_it(
    url: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # refused before any file is made, but just in case
    with pytest.raises(errands.ConfigurationError) as caught:
        open_backend(url)
    assert message in str(caught.value)
    assert PASSWORD not in str(caught.value)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite:///jobs#2.db", "holds '#'"),
        ("sqlite:///jobs.db#", "holds '#'"),
        ("sqlite:///jobs.db?synchronous=FULL#x", "holds '#'"),
        ("sqlite:///jobs?3.db", "'3.db' after '?' is not an option (write name=value"),
        ("sqlite:///jobs.db?synchronous=FULL&frob", "'frob' after '?' is not an option"),
        ("sqlite:///jobs.db?=FULL", "'=FULL' after '?' is not an option"),
        ("sqlite:///jobs.db?synchronous=FULL&synchronous=OFF", "synchronous is given twice"),
        ("sqlite:///jobs.db?synchronous=", "synchronous=''"),
    ],
)
def test_a_sqlite_url_whose_path_would_be_cut_short_is_refused_and_opens_no_other_file(
    url: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A '#' ended the path (the rest was ignored) and a '?' part without '=' was dropped:
    sqlite:///jobs#2.db and sqlite:///jobs?3.db both opened (and created) 'jobs'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(errands.ConfigurationError) as caught:
        open_backend(url)
    text = str(caught.value)
    assert message in text, text
    if "#" in url or "3.db" in url:
        assert "rename it, or name a symbolic link to it" in text, text
    assert list(tmp_path.iterdir()) == []


def test_a_sqlite_path_is_taken_as_written_and_option_values_are_percent_decoded() -> None:
    assert parse_sqlite_url("sqlite:///dir%20x/j b.db?synchronous=%46ULL") == (
        "dir%20x/j b.db",
        {"synchronous": "FULL"},
    )
    assert parse_sqlite_url("sqlite:////abs/x.db?&write_timeout=30&") == (
        "/abs/x.db",
        {"write_timeout": "30"},
    )


def test_a_sqlite_url_naming_a_folder_or_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(errands.ConfigurationError, match="cannot open SQLite database"):
        open_backend(f"sqlite:///{tmp_path}")
    with pytest.raises(errands.ConfigurationError, match="does not exist; create it first"):
        open_backend(f"sqlite:///{tmp_path}/missing/errands.db")


def test_an_unreachable_postgres_server_is_refused_with_the_password_masked() -> None:
    url = f"postgresql://bob:{PASSWORD}@127.0.0.1:{closed_port()}/shop?connect_timeout=2"
    with pytest.raises(errands.ConfigurationError) as caught:
        open_backend(url)
    assert "cannot connect to PostgreSQL at postgresql://bob:***@127.0.0.1:" in str(caught.value)
    assert PASSWORD not in str(caught.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://bob:pw@db:5432/shop", "postgresql://bob:***@db:5432/shop"),
        ("postgresql://bob:p@ss:w@rd@db/shop", "postgresql://bob:***@db/shop"),
        ("postgresql://:pw@db/shop", "postgresql://:***@db/shop"),
        (
            "postgresql://db/shop?user=bob&password=pw&x=1",
            "postgresql://db/shop?user=bob&password=***&x=1",
        ),
        ("postgresql://bob@db/shop", "postgresql://bob@db/shop"),
        ("sqlite:////var/lib/errands.db", "sqlite:////var/lib/errands.db"),
    ],
)
def test_urls_shown_in_messages_and_logs_hide_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(url) in repr(errands.App(url))


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://bob:pw@db:5432/shop",
        "postgresql://bob:p@ss@db:5432/shop",  # an unescaped '@' inside the password
        "postgresql://bob:p:a:ss@db:5432/shop",
    ],
)
def test_the_postgres_url_shown_in_messages_masks_the_whole_password(url: str) -> None:
    display = parse_postgres_url(url).display
    assert display == "postgresql://bob:***@db:5432/shop"
