"""process_group= under torch.compile: 4 compiled gloo processes in 2 groups equal two independent eager runs.
(A file of its own, apart from test_compile.py's 2-process test: `make test-sbn` hands out files to its 2
workers, and the two compiled multi-process tests, 47 and 17 s, then run side by side instead of one after
the other on one worker while the other idles.) The gloo processes run groups_worker of gloo_workers.py."""
from __future__ import annotations

import pytest

from gloo_workers import assert_groups_match, groups_worker, run_ranks


@pytest.mark.slow
def test_four_compiled_ranks_in_two_groups_equal_two_independent_eager_runs(tmp_path):
    """process_group= under torch.compile: the functional collectives reduce within each group."""
    grouped = run_ranks(groups_worker, tmp_path / "four", world_size=4, args=(4, True), timeout_s=600)
    independent = run_ranks(groups_worker, tmp_path / "two", world_size=2, args=(2,))
    assert_groups_match(grouped, independent)
