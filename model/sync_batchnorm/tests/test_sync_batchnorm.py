"""SynchronizedBatchNorm against nn.BatchNorm on the concatenated batch (float64 1e-10, float32 1e-5).

Thread replicas run on CPU through the real replication callbacks (sync_batchnorm.unittest.run_replicas).
"""
from __future__ import annotations

import contextlib
import copy
import io
import pickle
import queue
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sync_batchnorm import (
    FutureResult,
    SlavePipe,
    execute_replication_callbacks,
    DataParallelWithCallback,
    SyncAbortedError,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    convert_model,
    revert_model,
)
from sync_batchnorm.batchnorm_reimpl import BatchNorm2dReimpl
from sync_batchnorm.unittest import make_replicas, run_replicas

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def randomize_affine(module: nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
        module.bias.copy_(torch.randn(module.bias.shape, generator=generator))


def pair(sync_class, plain_class, channels: int, dtype: torch.dtype, **kwargs):
    reference = plain_class(channels, **kwargs).to(dtype)
    sync = sync_class(channels, **kwargs).to(dtype)
    if reference.affine:
        randomize_affine(reference)
        sync.load_state_dict(reference.state_dict())
    return sync, reference


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


# --------------------------------------------------------------------------------------------------
# Numerics: eps, large means, low precision, memory formats, gradcheck.
# --------------------------------------------------------------------------------------------------
def test_eps_is_added_to_the_variance_like_nn_batchnorm():
    # A nearly constant channel: variance << eps. A clamp (max(var, eps)) would give another answer.
    dtype = torch.float64
    sync, reference = pair(SynchronizedBatchNorm2d, nn.BatchNorm2d, 2, dtype, eps=1e-2)
    x = torch.randn(6, 2, 3, 3, dtype=dtype)
    x[:, 0] = 1.0 + 1e-3 * x[:, 0]
    outputs = run_replicas(make_replicas(sync, 2), list(x.split([2, 4])))
    assert_close(torch.cat(outputs), reference(x), dtype, "output")


def naive_sum_of_squares_variance(x: torch.Tensor) -> torch.Tensor:
    """What a sum / sum-of-squares reduction computes (the original package's approach)."""
    columns = x.transpose(0, 1).reshape(x.size(1), -1)
    count = columns.size(1)
    mean = columns.sum(1) / count
    return (columns * columns).sum(1) / count - mean * mean


def test_large_mean_float32_normalizes_to_unit_std():
    torch.manual_seed(0)
    x = torch.randn(8, 4, 16, 16) + 1e4
    # The naive formula breaks down here: this is what the test guards against.
    naive = naive_sum_of_squares_variance(x)
    assert (naive - 1).abs().max() > 0.5
    replicas = make_replicas(SynchronizedBatchNorm2d(4, affine=False), 2)
    outputs = torch.cat(run_replicas(replicas, list(x.split([3, 5]))))
    std = outputs.transpose(0, 1).reshape(4, -1).std(1)
    assert (std - 1).abs().max() < 1e-2, std
    assert outputs.mean().abs() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_input_keeps_dtype_with_float32_statistics(dtype):
    torch.manual_seed(0)
    x64 = torch.randn(6, 3, 5, 5, dtype=torch.float64) * 2 + 50
    x = x64.to(dtype)
    reference = nn.BatchNorm2d(3).double()
    expected = reference(x.double())  # float64 statistics of the very same low-precision values
    sync = SynchronizedBatchNorm2d(3)
    replicas = make_replicas(sync, 2)
    chunks = [c.clone().requires_grad_() for c in x.split([2, 4])]
    outputs = run_replicas(replicas, chunks)
    assert all(o.dtype == dtype for o in outputs)
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    assert all(c.grad.dtype == dtype for c in chunks)
    assert replicas[0].running_mean.dtype == torch.float32
    # running statistics are float32-accurate (a mean of ~50 in fp16/bf16 arithmetic would not be)
    torch.testing.assert_close(replicas[0].running_mean.double(), reference.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(replicas[0].running_var.double(), reference.running_var, rtol=1e-5, atol=1e-5)
    resolution = 1e-2 if dtype == torch.float16 else 4e-2
    torch.testing.assert_close(torch.cat(outputs).double(), expected, rtol=resolution, atol=resolution)


def test_under_autocast_statistics_are_float32_and_output_follows_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), SynchronizedBatchNorm2d(4))
    replicas = make_replicas(model, 2)
    x = torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = run_replicas(replicas, list(x.split(2)), call=lambda replica, i, inp: _autocast_call(replica, inp))
        conv_out = torch.cat([replicas[0][0](c) for c in x.split(2)])
    assert conv_out.dtype == torch.bfloat16
    assert all(o.dtype == torch.bfloat16 for o in outputs)
    reference = nn.BatchNorm2d(4).double()
    reference(conv_out.double())
    torch.testing.assert_close(replicas[0][1].running_mean.double(), reference.running_mean, rtol=1e-5, atol=1e-6)


def _torch_style_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """torch.nn.parallel.parallel_apply's threading, on CPU: each thread re-enters autocast with
    `enabled=` only (torch: `torch.amp.autocast(device_type, enabled=autocast_enabled)`), which gives the
    device's default dtype (CPU: bf16, CUDA: fp16) whatever dtype the caller chose."""
    autocast_enabled, results = torch.is_autocast_enabled("cpu"), [None] * len(modules)
    kwargs_tup = kwargs_tup or ({},) * len(modules)

    def worker(index):
        with torch.amp.autocast("cpu", enabled=autocast_enabled):
            inp = inputs[index] if isinstance(inputs[index], (list, tuple)) else (inputs[index],)
            results[index] = modules[index](*inp, **kwargs_tup[index])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(modules))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


class _RecordsAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x), torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_data_parallel_replica_threads_autocast_with_the_callers_dtype(monkeypatch, no_accelerator, dtype):
    """bf16 under --gpus trained in fp16 (without a GradScaler): the replica threads lost the dtype."""
    from sync_batchnorm import replicate

    monkeypatch.setattr(replicate, "parallel_apply", _torch_style_parallel_apply)
    wrapped = DataParallelWithCallback(_RecordsAutocast(), device_ids=[])
    replicas = make_replicas(wrapped.module, 2)
    with torch.autocast("cpu", dtype=dtype):
        outputs = wrapped.parallel_apply(replicas, [(torch.randn(2, 4),), (torch.randn(3, 4),)], None)
    assert [(out.dtype, seen, enabled) for out, seen, enabled in outputs] == [(dtype, dtype, True)] * 2
    outputs = wrapped.parallel_apply(replicas, [(torch.randn(2, 4),), (torch.randn(3, 4),)], None)
    assert [(out.dtype, enabled) for out, _, enabled in outputs] == [(torch.float32, False)] * 2


def _autocast_call(replica, inp):
    # autocast state is thread-local: each replica thread enters it, as parallel_apply does
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return replica(inp)


@pytest.mark.parametrize(
    "sync_class, plain_class, shape, memory_format",
    [
        (SynchronizedBatchNorm2d, nn.BatchNorm2d, (4, 3, 5, 6), torch.channels_last),
        (SynchronizedBatchNorm3d, nn.BatchNorm3d, (4, 3, 3, 4, 5), torch.channels_last_3d),
    ],
)
def test_channels_last_keeps_memory_format(sync_class, plain_class, shape, memory_format):
    dtype = torch.float64
    sync, reference = pair(sync_class, plain_class, shape[1], dtype)
    x = torch.randn(shape, dtype=dtype).to(memory_format=memory_format)
    upstream = torch.randn_like(x)
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(upstream)
    chunks = [c.clone().requires_grad_() for c in x.split([1, 3])]
    assert all(c.is_contiguous(memory_format=memory_format) for c in chunks)
    outputs = run_replicas(make_replicas(sync, 2), chunks)
    torch.autograd.backward(outputs, list(upstream.split([1, 3])))
    for output, chunk in zip(outputs, chunks):
        assert output.is_contiguous(memory_format=memory_format)
        assert chunk.grad.is_contiguous(memory_format=memory_format)
    assert_close(torch.cat([c.grad for c in chunks]), x_ref.grad, dtype, "input grad")
    # single device too
    single = sync_class(shape[1])
    assert single(x.float()).is_contiguous(memory_format=memory_format)


def _reference_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """torch.batch_norm_backward_elemt's formula (its CUDA kernel), in float64, for CPU tensors."""
    view = lambda t: t.double().view(1, -1, *([1] * (x.dim() - 2)))  # noqa: E731
    total = count.sum().double()
    gamma = weight if weight is not None else torch.ones_like(mean)
    grad = (dy.double() - view(sum_dy) / total - (x.double() - view(mean)) * view(invstd.square() * sum_dy_xmu) / total)
    return (grad * view(invstd * gamma)).to(dy.dtype)


@pytest.mark.parametrize("splits", [[3, 5], [1, 2, 3]])
def test_fused_cuda_backward_wiring_matches_batchnorm_on_the_concatenated_batch(monkeypatch, splits):
    """The CUDA path's one-pass input gradient, run on CPU with a reference of the kernel's formula."""
    from sync_batchnorm import functions

    calls = []

    def kernel(*args):
        calls.append(args[-1].tolist())
        return _reference_backward_elemt(*args)

    monkeypatch.setattr(functions, "uses_fused_kernels", lambda tensor: True)
    monkeypatch.setattr(torch, "batch_norm_backward_elemt", kernel)
    sync, reference = pair(SynchronizedBatchNorm2d, nn.BatchNorm2d, 3, torch.float64)
    x = torch.randn(sum(splits), 3, 4, 5, dtype=torch.float64) * 2 + 1
    upstream = torch.randn_like(x)
    pieces = [piece.clone().requires_grad_() for piece in x.split(splits)]
    replicas = make_replicas(sync, len(splits))
    outputs = run_replicas(replicas, pieces)
    torch.autograd.backward(outputs, list(upstream.split(splits)))
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(upstream)
    assert_close(torch.cat([p.grad for p in pieces]), x_ref.grad, torch.float64, "input gradient")
    assert calls == [[sum(splits) * 20]] * len(splits)  # each replica, with the global count


def test_gradcheck_thread_replicas():
    torch.manual_seed(0)
    sync = SynchronizedBatchNorm2d(3).double()
    replicas = make_replicas(sync, 2)
    x1 = torch.randn(2, 3, 3, 2, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(3, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def call(replica, index, inp):
        return torch.func.functional_call(replica, {"weight": weight, "bias": bias}, (inp,))

    def function(a, b, w, c):
        outputs = run_replicas(replicas, [a, b], call=call)
        return tuple(outputs)

    assert torch.autograd.gradcheck(function, (x1, x2, weight, bias), eps=1e-6, atol=1e-6)


def test_gradcheck_single_replica_synchronized_path():
    """The path torch.distributed uses, here with no process group (one replica merges alone)."""
    torch.manual_seed(1)
    sync = SynchronizedBatchNorm2d(3).double()
    del sync.weight, sync.bias  # plain attributes, so gradcheck's inputs flow into the layer
    x = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def function(inp, w, b):
        sync.weight, sync.bias = w, b
        return sync._forward_synchronized(inp, None, 0.1, sync.running_mean, sync.running_var)

    assert torch.autograd.gradcheck(function, (x, weight, bias), eps=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Failure handling: no hangs, uneven replica counts, clear errors.
# --------------------------------------------------------------------------------------------------
class FailOnFlag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("replica failure injected by the test")
        return x


@pytest.mark.parametrize("failing_copy", [0, 2])
def test_failing_replica_makes_every_replica_raise_quickly_and_next_step_works(failing_copy):
    model = nn.Sequential(FailOnFlag(), SynchronizedBatchNorm2d(3), SynchronizedBatchNorm2d(3))
    model[1].sync_timeout = 120.0  # the abort must come long before this
    replicas = make_replicas(model, 3)
    replicas[failing_copy][0].fail = True
    start = time.monotonic()
    with pytest.raises((RuntimeError, SyncAbortedError)):
        run_replicas(replicas, [torch.randn(2, 3, 4, 4) for _ in range(3)], join_timeout=30)
    assert time.monotonic() - start < 10
    replicas[failing_copy][0].fail = False
    x = torch.randn(6, 3, 4, 4, dtype=torch.float32)
    outputs = run_replicas(replicas, list(x.split(2)))
    expected = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3))(x)
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=1e-5, atol=1e-5)


def test_timeout_bounds_the_wait_when_a_replica_never_arrives():
    sync = SynchronizedBatchNorm2d(3)
    replicas = make_replicas(sync, 2)
    replicas[0].sync_timeout = 0.5
    from sync_batchnorm import execute_replication_callbacks

    execute_replication_callbacks(replicas)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        replicas[0](torch.randn(2, 3, 2, 2))  # the master alone: its slave never comes
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("bad_copy", [0, 1, 3])
def test_a_layer_error_in_one_thread_replica_aborts_the_round_for_the_others(bad_copy):
    """Without DataParallelWithCallback's guard: the layer itself fails the rendezvous."""
    sync = SynchronizedBatchNorm2d(3)
    sync.sync_timeout = 120.0
    replicas = make_replicas(sync, 4)
    inputs = [torch.randn(2, 3, 4, 4) for _ in range(4)]
    inputs[bad_copy] = torch.randn(2, 5, 4, 4)  # wrong channel count
    start = time.monotonic()
    with pytest.raises((ValueError, SyncAbortedError)) as error:
        run_replicas(replicas, inputs, join_timeout=30, guard=False)
    assert time.monotonic() - start < 10
    assert "expected 3 channels" in str(error.value) or "expected 3 channels" in str(error.value.__cause__)


def test_the_round_timeout_bounds_the_whole_wait_not_each_message():
    sync = SynchronizedBatchNorm2d(3)
    sync.sync_timeout = 1.0
    replicas = make_replicas(sync, 3)
    execute_replication_callbacks(replicas)
    def arrive_late():
        time.sleep(0.7)
        with contextlib.suppress(SyncAbortedError, TimeoutError):  # the master gave up on this round
            replicas[1](torch.randn(2, 3, 2, 2))

    late = threading.Thread(target=arrive_late, daemon=True)
    late.start()  # one slave comes late, the other never: the master gives up 1 s after it started
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="only 1 arrived"):
        replicas[0](torch.randn(2, 3, 2, 2))
    assert time.monotonic() - start < 1.6
    late.join(5)


def test_slave_pipe_keeps_the_original_call_shape():
    future = FutureResult()
    pipe = SlavePipe(1, queue.Queue(), future)
    assert pipe.timeout > 0
    future.put("result")
    assert pipe.run_slave("message") == "result" and pipe.queue.get_nowait() == (1, "message")


def test_fewer_replicas_than_previous_step():
    sync, reference = pair(SynchronizedBatchNorm2d, nn.BatchNorm2d, 3, torch.float64)
    replicas = make_replicas(sync, 4)
    for count, batch in [(4, 8), (2, 3), (1, 2), (3, 5)]:
        x = torch.randn(batch, 3, 3, 3, dtype=torch.float64)
        splits = [len(c) for c in x.tensor_split(count)]
        outputs = run_replicas(replicas[:count], list(x.split(splits)))
        assert_close(torch.cat(outputs), reference(x), torch.float64, f"{count} replicas")


def test_one_value_per_channel_raises_value_error():
    sync = SynchronizedBatchNorm1d(3)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(torch.randn(1, 3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync._forward_synchronized(torch.randn(1, 3), None, 0.1, sync.running_mean, sync.running_var)
    # thread replicas where the total is a single value: one replica with one sample, one with none
    replicas = make_replicas(SynchronizedBatchNorm1d(3), 2)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        run_replicas(replicas, [torch.randn(1, 3), torch.randn(0, 3)])


@pytest.mark.parametrize(
    "module, shape, expected",
    [
        (SynchronizedBatchNorm2d(3), (2, 3, 4), r"expected 4D input of shape \(N, 3, H, W\), got 3D input of shape \(2, 3, 4\)"),
        (SynchronizedBatchNorm2d(3), (2, 5, 4, 4), r"expected 3 channels .* got shape \(2, 5, 4, 4\)"),
        (SynchronizedBatchNorm1d(3), (2, 3, 4, 4), r"expected 2D or 3D input"),
        (SynchronizedBatchNorm3d(3), (2, 3, 4, 4), r"expected 5D input"),
    ],
)
def test_wrong_shape_raises_value_error_with_expected_and_actual(module, shape, expected):
    with pytest.raises(ValueError, match=expected):
        module(torch.randn(shape))


# --------------------------------------------------------------------------------------------------
# State dict, copies, conversion.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sync_class, plain_class",
    [(SynchronizedBatchNorm1d, nn.BatchNorm1d), (SynchronizedBatchNorm2d, nn.BatchNorm2d),
     (SynchronizedBatchNorm3d, nn.BatchNorm3d)],
)
def test_state_dict_keys_equal_nn_batchnorm_and_load_strictly_both_ways(sync_class, plain_class):
    sync, plain = sync_class(5), plain_class(5)
    assert list(sync.state_dict()) == list(plain.state_dict())
    randomize_affine(plain)
    plain.running_mean.uniform_()
    plain.num_batches_tracked.fill_(7)
    sync.load_state_dict(plain.state_dict(), strict=True)
    back = plain_class(5)
    back.load_state_dict(sync.state_dict(), strict=True)
    for key, value in plain.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)


def test_deepcopy_pickle_and_torch_save_of_module_and_wrapped_model(tmp_path, no_accelerator):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), SynchronizedBatchNorm2d(4))
    # run one synchronized round first so runtime rendezvous state exists
    run_replicas(make_replicas(model, 2), [torch.randn(2, 3, 3, 3), torch.randn(2, 3, 3, 3)])
    model(torch.randn(2, 3, 3, 3))
    model.eval()
    x = torch.randn(2, 3, 3, 3)
    expected = model(x)
    wrapped = DataParallelWithCallback(model, device_ids=[])
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), copy.deepcopy(wrapped).module,
              pickle.loads(pickle.dumps(wrapped)).module]
    for obj in (model, wrapped):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        copies.append(loaded.module if isinstance(loaded, nn.DataParallel) else loaded)
    for loaded in copies:
        assert torch.equal(loaded(x), expected)
        loaded.train()
        loaded(torch.randn(2, 3, 3, 3))  # still trains on one device
    # a copy trains as replicas too
    run_replicas(make_replicas(copies[1], 2), [torch.randn(2, 3, 3, 3), torch.randn(2, 3, 3, 3)])


def test_state_dict_of_wrapped_model_loads_into_plain_batchnorm(tmp_path, no_accelerator):
    model = DataParallelWithCallback(nn.Sequential(nn.Conv2d(3, 4, 1), SynchronizedBatchNorm2d(4)), device_ids=[])
    path = tmp_path / "weights.pt"
    torch.save(model.module.state_dict(), path)
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    plain.load_state_dict(torch.load(path, weights_only=True), strict=True)


def test_convert_and_revert_share_tensors_and_keep_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36)))
    model(torch.randn(4, 3, 3, 3))  # non-trivial running stats
    model.eval()
    x = torch.randn(2, 3, 3, 3)
    expected = model(x)
    weight = model[1].weight
    converted = convert_model(model)
    assert isinstance(converted[1], SynchronizedBatchNorm2d)
    assert isinstance(converted[2][1], SynchronizedBatchNorm1d)
    assert converted[1].weight is weight and not converted[1].training
    assert torch.equal(converted(x), expected)
    reverted = revert_model(converted)
    assert type(reverted[1]) is nn.BatchNorm2d and type(reverted[2][1]) is nn.BatchNorm1d
    assert torch.equal(reverted(x), expected)


def test_convert_data_parallel_keeps_device_ids(no_accelerator):
    wrapped = nn.DataParallel(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), device_ids=[])
    converted = convert_model(wrapped)
    assert isinstance(converted, DataParallelWithCallback)
    # without an accelerator DataParallel keeps only device_ids (no dim or output_device attributes)
    assert converted.device_ids == wrapped.device_ids
    assert getattr(converted, "dim", 0) == getattr(wrapped, "dim", 0)
    assert isinstance(converted.module[1], SynchronizedBatchNorm2d)
    reverted = revert_model(converted)
    assert type(reverted) is nn.DataParallel and type(reverted.module[1]) is nn.BatchNorm2d


def test_reverted_model_traces_for_export():
    model = convert_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    model(torch.randn(4, 3, 8, 8))
    model.eval()
    traced = torch.jit.trace(revert_model(model), torch.randn(1, 3, 8, 8))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(traced(x), model(x))


def test_no_distributed_means_plain_batch_norm_even_with_group_attribute():
    sync = SynchronizedBatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2)
    assert torch.equal(sync(x), F.batch_norm(x, None, None, sync.weight, sync.bias, True, 0.1, sync.eps))


def test_synchronizes_tells_whether_replicas_will_reduce_together():
    from sync_batchnorm import execute_replication_callbacks

    alone = SynchronizedBatchNorm2d(3)
    assert not alone.synchronizes()
    replicas = make_replicas(alone, 2)
    execute_replication_callbacks(replicas)
    assert all(r.synchronizes() for r in replicas)
    single = make_replicas(alone, 1)
    execute_replication_callbacks(single)  # one replica (e.g. the last, smallest batch): nothing to wait for
    assert not single[0].synchronizes()
