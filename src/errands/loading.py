"""Find the user's App from a ``module:attribute`` path.

Below both the CLI (``errands worker shop.jobs:app``, -A/--app, ERRANDS_APP) and the
worker (a process-pool child imports the app again in its own process), so neither has to
import the other. The CLI turns :class:`AppLoadError` into a usage error.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import sys
import sysconfig
import traceback
from types import TracebackType
from urllib.parse import quote, urlsplit

from .app import App
from .errors import ConfigurationError, ErrandsError, ResultTimeout


class AppLoadError(ConfigurationError):
    """No App at the path given (or no path and no URL); the message says what to pass."""


class AppImportError(ConfigurationError):
    """The user's module raised while it was imported: the message names the error and the
    file and line where it happened, with the user's own frames (none of importlib's or
    errands')."""


def load_app(
    path: str | None, url: str | None = None, *, need_code: bool = False, existing: bool = False
) -> App:
    """Import ``module:attr`` and return the App; with only ``url``, a bare App on it.

    ``need_code``: the caller runs jobs, so the module defining them is required.
    ``existing``: the caller only reads or administers, so a SQLite file that does not
    exist is a typo, not a new database to create.
    """
    if not path:
        if need_code:
            raise AppLoadError(
                "no app given: a worker needs the module that defines your jobs; pass "
                "module:app (as in `errands worker shop.jobs:app`), -A/--app module:app, "
                "or set ERRANDS_APP"
            )
        if not (url or os.environ.get("ERRANDS_URL")):
            raise AppLoadError(
                "no database given: pass --url (e.g. --url sqlite:///errands.db), "
                "-A/--app module:app, or set ERRANDS_URL or ERRANDS_APP"
            )
        app = App(url) if url else App()
        if existing:
            _check_exists(app.url)
        return app
    module_name, _, attr = path.partition(":")
    attr = attr or "app"
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not _names_the_module(exc, module_name):  # the module imports a missing one
            raise AppImportError(import_error_message(module_name, exc)) from None
        raise AppLoadError(
            f"cannot import module {module_name!r} (from {path!r}): {exc}. "
            f"Run from your project's folder ({os.getcwd()} now), or check the module path"
        ) from None
    except Exception as exc:
        raise AppImportError(import_error_message(module_name, exc)) from None
    try:
        app = getattr(module, attr)
    except AttributeError:
        raise AppLoadError(
            f"module {module_name!r} has no attribute {attr!r}; "
            f"write module:attribute, as in {module_name}:app"
        ) from None
    if not isinstance(app, App):
        raise AppLoadError(f"{path!r} is a {type(app).__name__}, not an errands.App")
    if url:
        app.url = url
    if existing:
        _check_exists(app.url)
    return app


def _check_exists(url: str) -> None:
    """A SQLite file a reading or administering command may open: one that exists, and is
    not another application's database (opening it as a store created the errands tables
    in it, beside that application's own)."""
    path = sqlite_file(url)
    if path is None:
        return
    if not os.path.exists(path):
        raise AppLoadError(
            f"no errands database at {path!r} (from {url}); check --url, "
            "ERRANDS_URL or the folder you run from"
        )
    if _foreign_sqlite(path):
        raise AppLoadError(
            f"{path!r} (from {url}) is a SQLite database with tables of its own and no "
            "errands store: check --url, ERRANDS_URL or the folder you run from; to keep "
            f"errands' tables in that file, create them first: errands migrate --url {url}"
        )


def _foreign_sqlite(path: str) -> bool:
    """Whether the SQLite file holds tables but no ``errands_migrations`` (which every
    errands store has, made by ``errands migrate`` or a worker, Django's migrate too).
    Read-only; a file that cannot be read so is left to the store to judge."""
    if os.path.getsize(path) == 0:
        return False
    try:
        conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=1.0)
        try:
            tables = {
                row[0]
                for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        finally:
            conn.close()
    except sqlite3.Error:  # not a database, locked, unreadable: the store says which
        return False
    return bool(tables) and "errands_migrations" not in tables


def _names_the_module(exc: ModuleNotFoundError, module_name: str) -> bool:
    """Whether the module not found is the one asked for (or a package on its path)."""
    missing = exc.name or ""
    return bool(missing) and (module_name == missing or module_name.startswith(missing + "."))


def _library_folders() -> tuple[str, ...]:
    """Where Python's own modules and installed packages live: not the user's code."""
    paths = sysconfig.get_paths()
    folders = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    folders.add(os.path.dirname(os.path.abspath(__file__)))  # errands itself
    return tuple(os.path.join(os.path.abspath(f), "") for f in folders)


def user_frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    """The frames of a traceback that are the user's code: not importlib's machinery
    (``<frozen ...>``), not the standard library, installed packages or errands."""
    libraries = _library_folders()
    return [
        frame
        for frame in traceback.extract_tb(tb)
        if not frame.filename.startswith("<")
        and not os.path.abspath(frame.filename).startswith(libraries)
    ]


def _shown_path(filename: str) -> str:
    path = os.path.abspath(filename)
    here = os.path.join(os.getcwd(), "")
    return path[len(here) :] if path.startswith(here) else path


def import_error_message(module_name: str, exc: BaseException) -> str:
    """``while importing shop (shop.py, line 57): ResultTimeout: ...``, then the
    user's own frames, then a hint when the error says what went wrong."""
    frames = user_frames(exc.__traceback__)
    if not frames:  # the user's code is an installed package: show its frames all the same
        errands_folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
        frames = [
            frame
            for frame in traceback.extract_tb(exc.__traceback__)
            if not frame.filename.startswith("<")
            and not os.path.abspath(frame.filename).startswith(errands_folder)
        ]
    where = ""
    if isinstance(exc, SyntaxError) and exc.filename:  # no frame of its own: where it is
        where = f" ({_shown_path(exc.filename)}, line {exc.lineno})"
    elif frames:
        where = f" ({_shown_path(frames[-1].filename)}, line {frames[-1].lineno})"
    if isinstance(exc, ErrandsError) and not isinstance(exc, ResultTimeout):
        # errands' own message says what is wrong and how to fix it: where is enough
        return f"while importing {module_name}{where}: {exc}"
    lines = [f"while importing {module_name}{where}: {type(exc).__name__}: {exc}"]
    if frames:
        lines.append("Traceback (your code, most recent call last):")
        lines += [
            line.rstrip("\n")
            for frame in traceback.format_list(frames)
            for line in frame.splitlines()
        ]
    if isinstance(exc, ResultTimeout):
        lines.append(
            "Importing a module runs its top-level code, and a worker imports yours to find "
            "the jobs: keep enqueue and handle.result() calls out of it (in another script, "
            'or under `if __name__ == "__main__":`)'
        )
    elif isinstance(exc, ModuleNotFoundError):
        lines.append(f"Install the missing package ({exc.name}) where the worker runs")
    return "\n".join(lines)


def sqlite_file(url: str) -> str | None:
    """The absolute path of a SQLite URL's file; None for another database or :memory:."""
    if not url.startswith("sqlite:"):
        return None
    from .backends.sqlite.backend import parse_sqlite_url

    path, _ = parse_sqlite_url(url)
    return None if path == ":memory:" else os.path.abspath(path)


def absolute_url(url: str) -> str:
    """A SQLite URL with its file as an absolute path (``sqlite:////home/me/shop.db``), so
    logs and messages say which file it is whatever the folder; other URLs as they are."""
    path = sqlite_file(url)
    if path is None:
        return url
    query = urlsplit(url).query
    return f"sqlite:///{path}" + (f"?{query}" if query else "")
