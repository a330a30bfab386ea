"""compiled.py on a torch without `all_gather_single_autograd` (the GPU image ships torch 2.11, where only the
older `all_gather_tensor_autograd` exists): hidden in two gloo processes, the compiled layers must still
compile without a graph break and train like eager and like nn.BatchNorm2d on the global batch. The
processes run fallback_workers.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compile_workers import LEARNING_RATE, STEPS, build, global_batch, loss_share
from fallback_workers import older_gather_worker
from gloo_workers import run_ranks

LOSS_TOLERANCE = 1e-4  # compiled against eager (float32), as test_compile.py


@pytest.mark.slow
def test_the_compiled_layer_trains_through_the_older_functional_all_gather(tmp_path):
    results = run_ranks(older_gather_worker, tmp_path, timeout_s=600)
    reference = build(nn.BatchNorm2d)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LEARNING_RATE)
    expected_losses = []
    for step in range(STEPS):
        x, upstream = global_batch(step)
        loss = loss_share(reference(x), upstream)
        loss.backward()
        expected_losses.append((loss.item(), [parameter.grad.clone() for parameter in reference.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
    for rank, r in enumerate(results):
        assert (r["graphs"], r["graph_breaks"]) == (1, 0), (rank, r["break_reasons"])
        assert r["hidden"] and r["older"], r  # what compiled.py imports has only the older function
        for step, (expected_loss, expected_grads) in enumerate(expected_losses):
            eager, compiled_run = float(r["eager"][f"loss{step}"]), float(r["compiled"][f"loss{step}"])
            assert abs(compiled_run - eager) <= LOSS_TOLERANCE, (rank, step, compiled_run, eager)
            assert compiled_run == pytest.approx(expected_loss, rel=1e-5, abs=1e-6), (rank, step)
            for got, expected in zip(r["compiled"][f"grads{step}"], expected_grads):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
        for name in ("bn1", "bn2"):
            layer = getattr(reference, name)
            torch.testing.assert_close(r["compiled"][f"{name}_running"],
                                       torch.stack([layer.running_mean, layer.running_var]), rtol=1e-5, atol=1e-6)
