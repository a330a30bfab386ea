"""SynchronizedBatchNorm against nn.BatchNorm on the concatenated batch (float64 1e-10, float32 1e-5): one
device, and thread replicas on CPU through the real replication callbacks (sync_batchnorm.unittest.run_replicas).
Numerics in test_numerics.py, failures and state in test_failures_and_state.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sync_batchnorm import SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from sync_batchnorm.batchnorm_reimpl import BatchNorm2dReimpl
from sync_batchnorm.unittest import make_replicas, run_replicas

from layer_pairs import assert_close, pair


# --------------------------------------------------------------------------------------------------
# One device: exactly nn.BatchNorm.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sync_class, plain_class, shape",
    [
        (SynchronizedBatchNorm1d, nn.BatchNorm1d, (6, 5)),
        (SynchronizedBatchNorm1d, nn.BatchNorm1d, (6, 5, 7)),
        (SynchronizedBatchNorm2d, nn.BatchNorm2d, (4, 5, 6, 7)),
        (SynchronizedBatchNorm3d, nn.BatchNorm3d, (2, 5, 3, 4, 5)),
    ],
)
@pytest.mark.parametrize(
    "options",
    [{}, {"momentum": None}, {"affine": False}, {"track_running_stats": False}, {"eps": 0.3, "momentum": 0.5}],
)
def test_single_device_is_bitwise_nn_batchnorm(sync_class, plain_class, shape, options):
    sync, reference = pair(sync_class, plain_class, shape[1], torch.float32, **options)
    for step in range(3):
        x = torch.randn(shape) * 2 + step
        x_sync, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_sync, y_ref = sync(x_sync), reference(x_ref)
        grad = torch.randn_like(y_ref)
        y_sync.backward(grad)
        y_ref.backward(grad)
        assert torch.equal(y_sync, y_ref)
        assert torch.equal(x_sync.grad, x_ref.grad)
        assert x_ref.grad.abs().sum() > 0
    for key, value in reference.state_dict().items():
        assert torch.equal(sync.state_dict()[key], value), key
    sync.eval()
    reference.eval()
    x = torch.randn(shape)
    assert torch.equal(sync(x), reference(x))


# --------------------------------------------------------------------------------------------------
# Thread replicas against nn.BatchNorm2d on the concatenated batch, several SGD steps.
# --------------------------------------------------------------------------------------------------
def run_steps_against_reference(splits, dtype, *, options=None, steps=3, spatial=(5, 6), channels=4,
                                memory_format=torch.contiguous_format, mean=0.0):
    options = options or {}
    sync, reference = pair(SynchronizedBatchNorm2d, nn.BatchNorm2d, channels, dtype, **options)
    replicas = make_replicas(sync, len(splits))
    learning_rate = 0.1
    for step in range(steps):
        x = (torch.randn(sum(splits), channels, *spatial, dtype=dtype) * (1 + step) + mean).to(
            memory_format=memory_format)
        upstream = torch.randn_like(x)
        x_ref = x.clone().requires_grad_()
        y_ref = reference(x_ref)
        y_ref.backward(upstream)

        chunks = [c.clone().requires_grad_() for c in x.split(splits)]
        outputs = run_replicas(replicas, chunks)
        torch.autograd.backward(outputs, list(upstream.split(splits)))

        assert_close(torch.cat(outputs), y_ref, dtype, f"step {step} output")
        assert_close(torch.cat([c.grad for c in chunks]), x_ref.grad, dtype, f"step {step} input grad")
        assert x_ref.grad.abs().max() > 1e-3, "upstream gradient must make the input gradient non-zero"
        if reference.affine:
            for name in ("weight", "bias"):
                total = sum(getattr(r, name).grad for r in replicas)
                expected = getattr(reference, name).grad
                assert expected.abs().max() > 1e-3
                assert_close(total, expected, dtype, f"step {step} {name} grad")
            with torch.no_grad():  # identical SGD step on the reference and on every replica
                for name in ("weight", "bias"):
                    total = sum(getattr(r, name).grad for r in replicas)
                    getattr(reference, name).sub_(learning_rate * getattr(reference, name).grad)
                    getattr(reference, name).grad = None
                    for r in replicas:
                        getattr(r, name).sub_(learning_rate * total)
                        getattr(r, name).grad = None
        if reference.track_running_stats:
            for r in replicas:
                assert_close(r.running_mean, reference.running_mean, dtype, "running_mean")
                assert_close(r.running_var, reference.running_var, dtype, "running_var")
                assert int(r.num_batches_tracked) == int(reference.num_batches_tracked) == step + 1
    # eval mode uses the running statistics, no synchronization
    for r in replicas:
        r.eval()
    reference.eval()
    x = torch.randn(3, channels, *spatial, dtype=dtype)
    if reference.track_running_stats:
        assert_close(replicas[0](x), reference(x), dtype, "eval output")
    return replicas, reference


@pytest.mark.parametrize("splits", [[3, 5], [1, 2, 3, 7]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_thread_replicas_equal_batchnorm_on_concatenated_batch(splits, dtype):
    run_steps_against_reference(splits, dtype)


@pytest.mark.parametrize(
    "options", [{"momentum": None}, {"affine": False}, {"track_running_stats": False}, {"eps": 0.25}]
)
def test_thread_replicas_options(options):
    run_steps_against_reference([3, 5], torch.float64, options=options)


def test_thread_replicas_one_sample_each_equal_batch_of_two():
    # nn.BatchNorm1d refuses a single sample; two replicas of one sample each are a batch of 2.
    sync, reference = pair(SynchronizedBatchNorm1d, nn.BatchNorm1d, 3, torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    outputs = run_replicas(make_replicas(sync, 2), list(x.split(1)))
    assert_close(torch.cat(outputs), reference(x), torch.float64, "output")


def test_uneven_spatial_sizes_are_count_weighted():
    dtype = torch.float64
    channels = 3
    shapes = [(2, channels, 5, 7), (3, channels, 4, 4), (1, channels, 9, 2)]
    sync, _ = pair(SynchronizedBatchNorm2d, nn.BatchNorm2d, channels, dtype)
    # Reference: every value of a channel in one row of a (1, C, L) tensor through nn.BatchNorm1d.
    reference = nn.BatchNorm1d(channels).to(dtype)
    reference.load_state_dict(sync.state_dict())
    inputs = [torch.randn(shape, dtype=dtype) * 3 + 1 for shape in shapes]
    upstreams = [torch.randn(shape, dtype=dtype) for shape in shapes]

    def flatten(tensors):
        return torch.cat([t.transpose(0, 1).reshape(channels, -1) for t in tensors], 1).unsqueeze(0)

    ref_inputs = [x.clone().requires_grad_() for x in inputs]
    y_ref = reference(flatten(ref_inputs))
    y_ref.backward(flatten(upstreams))

    replicas = make_replicas(sync, len(shapes))
    chunks = [x.clone().requires_grad_() for x in inputs]
    outputs = run_replicas(replicas, chunks)
    torch.autograd.backward(outputs, upstreams)
    assert_close(flatten(outputs), y_ref, dtype, "output")
    for chunk, ref_input in zip(chunks, ref_inputs):
        assert ref_input.grad.abs().max() > 1e-3
        assert_close(chunk.grad, ref_input.grad, dtype, "input grad")
    assert_close(sum(r.weight.grad for r in replicas), reference.weight.grad, dtype, "weight grad")
    assert_close(replicas[0].running_var, reference.running_var, dtype, "running_var")


def test_running_buffers_updated_in_place():
    sync = SynchronizedBatchNorm2d(4)
    replicas = make_replicas(sync, 2)
    pointers = [(r.running_mean.data_ptr(), r.running_var.data_ptr(), r.num_batches_tracked.data_ptr())
                for r in replicas]
    before = replicas[0].running_mean.clone()
    run_replicas(replicas, [torch.randn(2, 4, 3, 3) + 5, torch.randn(3, 4, 3, 3) + 5])
    assert not torch.equal(before, replicas[0].running_mean)
    assert pointers == [(r.running_mean.data_ptr(), r.running_var.data_ptr(), r.num_batches_tracked.data_ptr())
                        for r in replicas]


def test_matches_plain_autograd_reimplementation():
    """An independent reference: BatchNorm written with elementary ops, gradients from autograd."""
    dtype = torch.float64
    reimpl = BatchNorm2dReimpl(3).to(dtype)
    reimpl.reset_parameters()
    sync = SynchronizedBatchNorm2d(3).to(dtype)
    sync.load_state_dict(reimpl.state_dict(), strict=False)
    x = torch.randn(5, 3, 4, 4, dtype=dtype) * 2 + 3
    upstream = torch.randn_like(x)
    x_ref = x.clone().requires_grad_()
    reimpl(x_ref).backward(upstream)
    replicas = make_replicas(sync, 2)
    chunks = [c.clone().requires_grad_() for c in x.split([2, 3])]
    torch.autograd.backward(run_replicas(replicas, chunks), list(upstream.split([2, 3])))
    assert_close(torch.cat([c.grad for c in chunks]), x_ref.grad, dtype, "input grad")
    assert_close(replicas[0].running_var, reimpl.running_var, dtype, "running_var")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_replica_with_an_empty_share_adds_nothing_and_survives_the_backward(dtype):
    """A replica (or process) whose share of the batch is empty: torch 2.14's CPU batch-norm backward kernel
    divides by zero on an empty input (SIGFPE, the whole process dies); the synchronized layer skips it."""
    run_steps_against_reference([3, 0, 2], dtype, steps=2)
