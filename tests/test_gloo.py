"""tests.gloo.start_ranks: ranks forked from the forkserver see the environment of the call that started them."""
from __future__ import annotations

from tests import gloo


def test_ranks_see_an_environment_changed_after_the_forkserver_started(tmp_path, monkeypatch):
    monkeypatch.delenv("SYNCSEG_TEST_GLOO_MARK", raising=False)
    gloo.start_ranks(gloo.environment_worker, ("SYNCSEG_TEST_GLOO_MARK", str(tmp_path / "before.txt")), 1)
    assert (tmp_path / "before.txt").read_text() == "<unset>"
    assert gloo.start_method() in ("forkserver", "spawn")  # the environment as the server (if any) has it
    monkeypatch.setenv("SYNCSEG_TEST_GLOO_MARK", "changed")
    gloo.start_ranks(gloo.environment_worker, ("SYNCSEG_TEST_GLOO_MARK", str(tmp_path / "after.txt")), 1)
    assert (tmp_path / "after.txt").read_text() == "changed"
    assert gloo.start_method() == "spawn"
