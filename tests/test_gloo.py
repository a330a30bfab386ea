"""tests.gloo.start_ranks: ranks forked from the forkserver see the environment of the call that started them."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import gloo


def _server_pid():
    return getattr(getattr(gloo.forkserver, "_forkserver", None), "_forkserver_pid", None)


def test_ranks_see_an_environment_changed_after_the_forkserver_started(tmp_path, monkeypatch):
    """A forkserver's children get the environment it started with: after a change, a new server starts."""
    monkeypatch.delenv("SYNCSEG_TEST_GLOO_MARK", raising=False)
    gloo.start_ranks(gloo.environment_worker, ("SYNCSEG_TEST_GLOO_MARK", str(tmp_path / "before.txt")), 1)
    assert (tmp_path / "before.txt").read_text() == "<unset>"
    server = _server_pid()
    monkeypatch.setenv("SYNCSEG_TEST_GLOO_MARK", "changed")
    gloo.start_ranks(gloo.environment_worker, ("SYNCSEG_TEST_GLOO_MARK", str(tmp_path / "after.txt")), 1)
    assert (tmp_path / "after.txt").read_text() == "changed"
    if gloo.start_method() == "forkserver":
        assert _server_pid() not in (None, server)  # the old server stopped, a new one forked the rank


def test_the_forkserver_serves_every_test_not_only_the_one_that_started_it(tmp_path, monkeypatch):
    """pytest sets PYTEST_CURRENT_TEST to each test's name: a server started during one test still serves the
    next (without a restart: its preloaded imports are the point)."""
    if "forkserver" not in gloo.mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    gloo.start_ranks(gloo.environment_worker, ("PYTEST_CURRENT_TEST", str(tmp_path / "first.txt")), 1)
    server = _server_pid()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a later test (call)")
    gloo.start_ranks(gloo.environment_worker, ("PYTEST_CURRENT_TEST", str(tmp_path / "second.txt")), 1)
    assert _server_pid() == server is not None


def test_a_forked_main_starts_its_own_processes_as_a_new_interpreter_would(tmp_path):
    """run_module_ranks's ranks come from the forkserver, whose children inherit "forkserver" as their default
    start method; a command's DataLoader workers are forked (Linux, Python 3.11), and so must the ranks' be."""
    gloo.run_module_ranks(gloo.start_method_main, [str(tmp_path / "method.txt")], [gloo.plain_environment()],
                          [tmp_path / "rank0.log"])
    fresh = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert (tmp_path / "method.txt").read_text() == fresh


def test_ranks_past_the_timeout_fail_with_their_stacks_and_their_workers(tmp_path):
    """A hang in CI says where it is: the rank's and its forked worker's Python stacks are in the failure."""
    with pytest.raises(AssertionError, match="still running after 3 s") as failure:
        gloo.run_module_ranks(gloo.hanging_main, [str(tmp_path / "worker.pid")], [gloo.plain_environment()],
                              [tmp_path / "rank0.log"], timeout=3)
    message = str(failure.value)
    assert "in _hang_in_rank" in message and "in hanging_main" in message, message
    assert "in _hang_in_worker" in message, message
    worker = Path(f"/proc/{(tmp_path / 'worker.pid').read_text()}/stat")
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:  # it sees its rank gone and exits: nothing is left
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(stat: Path) -> bool:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
