"""Finding the user's App: errors while importing their module, and where the URL comes
from (one rule in Python and the CLI: --url, then the URL in code, then ERRANDS_URL)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import errands
from errands.cli.main import cli
from errands.errors import MAIN_MODULE_HINT
from errands.loading import AppImportError, AppLoadError, absolute_url, load_app


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty project folder, the current directory; modules written there are
    forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ERRANDS_URL", raising=False)
    monkeypatch.delenv("ERRANDS_APP", raising=False)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def write(folder: Path, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(source).lstrip())


SHOP_THAT_WAITS = """
import errands

app = errands.App("sqlite:///shop.db")


@app.job
def charge(order_id: int) -> None: ...


def wait() -> None:
    raise errands.ResultTimeout("job 2 (shop.charge) still available after 30 s")


wait()
"""


def test_an_error_while_importing_the_app_module_names_its_file_line_and_only_user_frames(
    project: Path,
) -> None:
    write(project, "fh_shop", SHOP_THAT_WAITS)
    with pytest.raises(AppImportError) as caught:
        load_app("fh_shop:app")
    message = str(caught.value)
    first = message.splitlines()[0]
    assert first == (
        "while importing fh_shop (fh_shop.py, line 11): ResultTimeout: "
        "job 2 (shop.charge) still available after 30 s"
    )
    assert 'File "' in message and ", line 14, in <module>" in message  # the call of wait()
    assert "importlib" not in message and "errands/loading.py" not in message
    assert "keep enqueue and handle.result() calls out of it" in message


def test_the_cli_reports_an_import_error_in_one_block_with_exit_1_and_no_click_frames(
    project: Path,
) -> None:
    write(project, "fh_shop2", SHOP_THAT_WAITS)
    result = CliRunner().invoke(cli, ["worker", "fh_shop2:app"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: while importing fh_shop2 (fh_shop2.py, line 11)")
    assert "click" not in result.output and "Usage:" not in result.output


def test_a_missing_dependency_is_an_error_in_the_users_module_not_a_wrong_module_path(
    project: Path,
) -> None:
    write(project, "fh_needs", "import errands\nimport no_such_dependency_xyz\n")
    with pytest.raises(AppImportError) as caught:
        load_app("fh_needs:app")
    message = str(caught.value)
    assert message.startswith(
        "while importing fh_needs (fh_needs.py, line 2): ModuleNotFoundError: "
        "No module named 'no_such_dependency_xyz'"
    )
    assert "Install the missing package (no_such_dependency_xyz)" in message
    assert "check the module path" not in message


def test_a_syntax_error_in_the_app_module_names_its_file_and_line(project: Path) -> None:
    write(project, "fh_broken", "import errands\n\napp = errands.App(\n")
    with pytest.raises(AppImportError, match=r"fh_broken \(fh_broken.py, line 3\): SyntaxError"):
        load_app("fh_broken:app")


def test_an_errands_error_while_importing_is_one_line_with_the_users_file_and_line(
    project: Path,
) -> None:
    source = "import errands\n\napp = errands.App()\n@app.periodic('61 * * * *')\ndef f(): ...\n"
    write(project, "fh_cron", source)
    with pytest.raises(AppImportError) as caught:
        load_app("fh_cron:app")
    message = str(caught.value)
    assert message.startswith("while importing fh_cron (fh_cron.py, line 4): periodic job 'f': bad")
    assert "\n" not in message


def test_a_module_that_is_not_there_still_asks_to_check_the_module_path(project: Path) -> None:
    with pytest.raises(AppLoadError, match="check the module path") as caught:
        load_app("fh_nowhere:app")
    assert not isinstance(caught.value, AppImportError)
    assert str(project) in str(caught.value)  # the folder it looked in


# -- where the URL comes from ---------------------------------------------------------------
SHOP_WITH_URL = """
import errands

app = errands.App("sqlite:///coded.db")
"""


def test_a_url_written_in_code_wins_over_errands_url_in_python(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ERRANDS_URL", "sqlite:///from-env.db")
    assert errands.App("sqlite:///coded.db").url == "sqlite:///coded.db"
    assert errands.App().url == "sqlite:///from-env.db"  # only when the code gives none


def test_a_url_written_in_code_wins_over_errands_url_in_the_cli_which_says_so(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(project, "fh_coded", SHOP_WITH_URL)
    monkeypatch.setenv("ERRANDS_URL", f"sqlite:///{project}/from-env.db")
    errands.App(f"sqlite:///{project}/coded.db").migrate()
    result = CliRunner().invoke(cli, ["status", "-A", "fh_coded:app"])
    assert result.exit_code == 0, result.output
    assert (
        f"warning: ERRANDS_URL (sqlite:///{project}/from-env.db) is not used: fh_coded:app "
        f"names its own database (sqlite:///{project}/coded.db)"
    ) in result.output
    assert not (project / "from-env.db").exists()


def test_errands_url_gives_the_database_when_the_cli_has_no_app(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    errands.App(f"sqlite:///{project}/env.db").migrate()
    monkeypatch.setenv("ERRANDS_URL", f"sqlite:///{project}/env.db")
    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "no jobs yet"


def test_the_url_option_overrides_the_apps_url(project: Path) -> None:
    write(project, "fh_coded2", SHOP_WITH_URL)
    errands.App(f"sqlite:///{project}/other.db").migrate()
    result = CliRunner().invoke(
        cli, ["status", "-A", "fh_coded2:app", "--url", f"sqlite:///{project}/other.db"]
    )
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output


def test_a_relative_sqlite_url_is_made_absolute_for_messages_and_logs(project: Path) -> None:
    assert absolute_url("sqlite:///shop.db?synchronous=FULL") == (
        f"sqlite:///{project}/shop.db?synchronous=FULL"
    )
    assert absolute_url("sqlite:////var/lib/shop.db") == "sqlite:////var/lib/shop.db"
    assert absolute_url("sqlite:///:memory:") == "sqlite:///:memory:"
    assert absolute_url("postgresql://db/shop") == "postgresql://db/shop"


# -- jobs named after __main__ ---------------------------------------------------------------
def test_enqueueing_a_job_defined_in_a_script_run_as_main_warns_once(app: errands.App) -> None:
    def charge_order(order_id: int) -> None: ...

    charge_order.__module__ = "__main__"
    charge_order.__qualname__ = "charge_order"  # as at a script's top level
    job = app.job(charge_order)
    assert job.name.startswith("__main__.")
    with pytest.warns(UserWarning, match="no worker can import") as caught:
        job.enqueue(order_id=1)
    assert caught[0].filename == __file__  # it points at the enqueue in the user's code
    job.enqueue(order_id=2)  # once is enough: no second warning (warnings are errors here)


def test_a_job_named_after_main_by_hand_does_not_warn(app: errands.App) -> None:
    def charge(order_id: int) -> None: ...

    charge.__module__ = "__main__"
    app.job(name="shop.charge")(charge).enqueue(order_id=1)


def test_the_unknown_job_error_for_a_main_job_says_why_no_worker_knows_it() -> None:
    error = errands.UnknownJob(
        "no handler registered for job '__main__.charge_order' in this worker; it knows: "
        "shop.charge_order"
    )
    assert str(error).endswith(MAIN_MODULE_HINT)
    assert MAIN_MODULE_HINT not in str(errands.UnknownJob("no handler for job 'shop.x'"))
    assert str(error).count(MAIN_MODULE_HINT) == 1
    assert str(type(error)(str(error))).count(MAIN_MODULE_HINT) == 1  # rebuilt: still once
