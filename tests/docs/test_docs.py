"""The docs stand alone and their examples match what the code prints."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from click.testing import CliRunner

from errands.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("**/*.md"))


def test_docs_stand_alone_without_references_to_the_internal_design_file() -> None:
    cited = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in [*DOCS, ROOT / "README.md"]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"DESIGN(\.md| §)|shared/DESIGN|§\d", line)
    ]
    assert DOCS and not cited, "\n".join(cited)


def test_the_migrate_example_in_docs_cli_lists_every_migration(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    example = text.split("$ errands migrate --url sqlite:///shop.db\n", 1)[1].split("$ ", 1)[0]
    result = CliRunner().invoke(cli, ["migrate", "--url", f"sqlite:///{tmp_path}/shop.db"])
    assert result.exit_code == 0, result.output
    assert example.splitlines() == result.output.splitlines()


def test_every_help_text_in_docs_cli_is_what_the_command_prints() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    blocks = re.findall(r"```text\n(Usage: errands[^\n]*\n.*?)```", text, flags=re.S)
    assert len(blocks) >= 18
    for block in blocks:
        words = block.split("\n", 1)[0].split("[OPTIONS]")[0].split()[2:]
        shown = CliRunner().invoke(cli, [*words, "--help"], prog_name="errands", terminal_width=79)
        assert block == shown.output, f"docs/cli.md: the help of `errands {' '.join(words)}`"


def test_docs_list_every_upstream_django_test_a_queued_backend_is_expected_to_fail() -> None:
    spec = importlib.util.spec_from_file_location(
        "upstream", ROOT / "integration" / "django" / "upstream.py"
    )
    assert spec is not None and spec.loader is not None
    upstream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream)  # stdlib only at import: no Django needed here
    text = (ROOT / "docs" / "integrations.md").read_text()
    for name, why in upstream.EXPECTED_FAILURES.items():
        assert f"| `{name}` | {why} |" in text, name
    assert f"Django {upstream.DJANGO_VERSION}'s own `tests/tasks`" in text
    pinned = (ROOT / "integration" / "requirements-django6.txt").read_text()
    assert f"django=={upstream.DJANGO_VERSION}" in pinned
