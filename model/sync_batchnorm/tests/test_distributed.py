"""gloo processes on CPU: two ranks with batches 3 and 5 equal nn.BatchNorm2d on the batch of 8; a rank that
takes an extra branch makes both raise one message naming the layers; 4 ranks in 2 sync groups equal two
independent 2-rank runs. The processes run functions of gloo_workers.py."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from gloo_workers import CHANNELS, LEARNING_RATE, STEPS, WORLD_SIZE, divergence_worker, global_batch, group_batch
from gloo_workers import assert_groups_match, groups_worker, initial_layer, numerics_worker, run_ranks


@pytest.mark.slow
def test_two_gloo_ranks_equal_single_process_batchnorm(tmp_path):
    results = run_ranks(numerics_worker, tmp_path)
    tol = dict(rtol=1e-10, atol=1e-10)
    reference = initial_layer(cls=nn.BatchNorm2d)
    for step in range(STEPS):
        x, upstream = global_batch(step)
        x = x.clone().requires_grad_()
        y = reference(x)
        y.backward(upstream)
        torch.testing.assert_close(torch.cat([r[f"y{step}"] for r in results]), y.detach(), **tol)
        assert x.grad.abs().max() > 1e-3
        torch.testing.assert_close(torch.cat([r[f"dx{step}"] for r in results]), x.grad, **tol)
        expected_params = torch.stack([reference.weight.grad, reference.bias.grad])
        for r in results:
            torch.testing.assert_close(r[f"dparams{step}"], expected_params, **tol)
        with torch.no_grad():
            reference.weight.sub_(LEARNING_RATE * reference.weight.grad)
            reference.bias.sub_(LEARNING_RATE * reference.bias.grad)
            reference.weight.grad = reference.bias.grad = None
    for r in results:
        torch.testing.assert_close(r["running_mean"], reference.running_mean, **tol)
        torch.testing.assert_close(r["running_var"], reference.running_var, **tol)
        assert int(r["num_batches_tracked"]) == STEPS
        assert r["host_reads"] == []  # forward and backward read nothing back to the host

    large = torch.cat([r["large_mean_output"] for r in results])
    std = large.transpose(0, 1).reshape(CHANNELS, -1).std(1)
    assert (std - 1).abs().max() < 1e-2, std

    # DDP: gradients averaged over ranks == gradient of the full-batch loss / world size
    model = nn.Sequential(nn.Conv2d(3, CHANNELS, 1).double(), initial_layer(cls=nn.BatchNorm2d))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1)
    x, upstream = global_batch(0)
    ((model(x[:, :3]) * upstream).sum() / WORLD_SIZE).backward()
    conv_weight, _, bn_weight, bn_bias = model.parameters()  # the conv bias gradient is 0 before a BN
    assert min(conv_weight.grad.abs().max(), bn_weight.grad.abs().max(), bn_bias.grad.abs().max()) > 1e-3
    for r in results:
        for got, p in zip(r["ddp_grads"], model.parameters()):
            torch.testing.assert_close(got, p.grad, **tol)


@pytest.mark.slow
def test_a_rank_taking_an_extra_branch_makes_every_rank_raise_one_message_naming_both_layers(tmp_path):
    start = time.monotonic()
    results = run_ranks(divergence_worker, tmp_path, timeout_s=60)
    elapsed = time.monotonic() - start
    for case, expected in [("extra", ["rank 0 called 'head' (call 1)", "rank 1 called 'extra' (call 1)"]),
                           ("twice", ["rank 0 called 'stem' (call 2)", "rank 1 called 'head' (call 1)"]),
                           ("deferred", ["rank 0 called 'head' (call 1)", "rank 1 called 'extra' (call 1)"])]:
        assert results[0][case] == results[1][case], case  # one message, on both ranks
        assert all(part in results[0][case] for part in expected), (case, results[0][case])
        assert "same order and the same number of times" in results[0][case]
    for rank in range(2):
        for case in ("extra", "twice"):
            assert results[rank][f"{case}_seconds"] < 5, results[rank]  # raised at the exchange, no hang
    print(f"2 gloo ranks, spawn to exit: {elapsed:.1f} s")


@pytest.mark.slow
def test_four_ranks_in_two_groups_equal_two_independent_two_rank_runs(tmp_path):
    grouped = run_ranks(groups_worker, tmp_path / "four", world_size=4, args=(4,))
    independent = run_ranks(groups_worker, tmp_path / "two", world_size=2, args=(2,))
    assert_groups_match(grouped, independent)
    # negative control: a group's statistics are not the whole world's
    x0, _ = group_batch(0, 0)
    x1, _ = group_batch(1, 0)
    world = initial_layer(cls=nn.BatchNorm2d)(torch.cat([x0, x1]))[: len(x0)]
    own = torch.cat([grouped[0][0]["y0"], grouped[1][0]["y0"]])
    assert (world - own).abs().max() > 0.1
