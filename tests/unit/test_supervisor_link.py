"""How a worker of ``--processes N`` knows its supervisor: a lifeline pipe (EOF once the
supervisor is gone), and never a stale variable (tests/acceptance/test_processes.py runs
the real processes)."""

from __future__ import annotations

import os
import tempfile
import threading

import pytest

from errands.worker.supervisor import SUPERVISOR_ENV, supervisor_link


def test_a_lifeline_reads_end_of_file_once_its_supervisor_closed_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read_end, write_end = os.pipe()
    try:
        monkeypatch.setenv(SUPERVISOR_ENV, f"{os.getppid()}:{read_end}")
        link = supervisor_link()
        assert link is not None and link.lifeline == read_end
        assert SUPERVISOR_ENV not in os.environ  # nothing the worker starts inherits it
        gone = threading.Event()
        threading.Thread(target=lambda: (link.wait_gone(), gone.set()), daemon=True).start()
        assert not gone.wait(0.3)  # the supervisor is there
        os.close(write_end)  # what its exit does, however it went
        assert gone.wait(10)
    finally:
        os.close(read_end)


def test_a_stale_variable_names_no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pid that is not this process's parent, with no descriptor or one that is not a
    pipe (a shell's leftover, a wrapper that forked): no supervisor to stop with."""
    not_parent = os.getppid() + 1
    monkeypatch.setenv(SUPERVISOR_ENV, str(not_parent))
    assert supervisor_link() is None
    with tempfile.TemporaryFile() as file:
        monkeypatch.setenv(SUPERVISOR_ENV, f"{not_parent}:{file.fileno()}")
        assert supervisor_link() is None
    monkeypatch.setenv(SUPERVISOR_ENV, f"{not_parent}:9999")  # not open
    assert supervisor_link() is None
    monkeypatch.setenv(SUPERVISOR_ENV, f"{os.getppid()}")  # started by one without pipes
    link = supervisor_link()
    assert link is not None and link.lifeline is None
