"""Numerics of the synchronized path: eps, large means, low precision and autocast, memory formats, the fused
CUDA backward's wiring (on CPU), gradcheck."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from sync_batchnorm import DataParallelWithCallback, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from sync_batchnorm.unittest import make_replicas, run_replicas

from layer_pairs import assert_close, pair


# --------------------------------------------------------------------------------------------------
# Numerics: eps, large means, low precision, memory formats, gradcheck.
# --------------------------------------------------------------------------------------------------
def test_eps_is_added_to_the_variance_like_nn_batchnorm():
    # A nearly constant channel: variance << eps, normalized by sqrt(var + eps) (the default eps mode, 'plus';
    # 'clamp' is in test_package.py)
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
