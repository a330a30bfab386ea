"""A divergence under torch.compile: a rank taking an extra branch in a compiled model raises one
SyncDivergenceError naming both layers, on both ranks; where reading the labels would wait for a device (as on
CUDA), at the diverging layer's next call. (A file of its own, apart from test_compile.py's training test:
`make test-sbn` hands out files to its 2 workers, and each part compiles for ~half a minute on an empty inductor
cache.) The gloo processes run divergence_worker of compile_workers.py."""
from __future__ import annotations

import pytest

from compile_workers import divergence_worker
from gloo_workers import run_ranks


@pytest.mark.slow
def test_a_compiled_rank_taking_an_extra_branch_raises_one_message_on_both_ranks(tmp_path):
    results = run_ranks(divergence_worker, tmp_path, timeout_s=900)
    for case in ("divergence", "deferred"):
        assert results[0][case] == results[1][case], case
        for part in ("rank 0 called 'head' (call 1)", "rank 1 called 'extra' (call 1)", "same number of times"):
            assert part in results[0][case], (case, results[0][case])
