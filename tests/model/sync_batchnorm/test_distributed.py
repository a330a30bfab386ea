"""Two gloo processes on CPU: per-rank batches 3 and 5 equal nn.BatchNorm2d on the batch of 8."""
from __future__ import annotations

import contextlib
import copy
import gc
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from model.sync_batchnorm import SynchronizedBatchNorm2d

WORLD_SIZE = 2
SPLITS = [3, 5]
CHANNELS = 4
STEPS = 3
LEARNING_RATE = 0.1
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def global_batch(step: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(sum(SPLITS), CHANNELS, 5, 6, generator=generator, dtype=dtype) * (1 + step) + 2
    upstream = torch.randn(x.shape, generator=generator, dtype=dtype)
    return x, upstream


def initial_layer(dtype=torch.float64, cls=SynchronizedBatchNorm2d) -> nn.Module:
    layer = cls(CHANNELS).to(dtype)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(CHANNELS, generator=generator, dtype=dtype) + 0.5)
        layer.bias.copy_(torch.randn(CHANNELS, generator=generator, dtype=dtype))
    return layer


@contextlib.contextmanager
def _forbid_host_reads():
    """Make every Tensor -> Python read raise (on CUDA each would wait for the device queue)."""
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    calls: list[str] = []

    def guard(name):
        def read(self, *args, **kwargs):
            calls.append(name)
            raise AssertionError(f"Tensor.{name} called on the synchronized path")
        return read

    for name in names:
        setattr(torch.Tensor, name, guard(name))
    try:
        yield calls
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=__import__("datetime").timedelta(seconds=TIMEOUT_S))
    try:
        layer = initial_layer()
        start = sum(SPLITS[:rank])
        results = {}
        for step in range(STEPS):
            x, upstream = global_batch(step)
            chunk = x[start:start + SPLITS[rank]].clone().requires_grad_()
            y = layer(chunk)
            y.backward(upstream[start:start + SPLITS[rank]])
            grads = torch.stack([layer.weight.grad, layer.bias.grad])
            dist.all_reduce(grads)  # what DDP does (up to its 1/world_size averaging)
            results[f"y{step}"] = y.detach()
            results[f"dx{step}"] = chunk.grad
            results[f"dparams{step}"] = grads
            with torch.no_grad():
                layer.weight.sub_(LEARNING_RATE * grads[0])
                layer.bias.sub_(LEARNING_RATE * grads[1])
                layer.weight.grad = layer.bias.grad = None
        x, upstream = global_batch(STEPS)
        chunk = x[start:start + SPLITS[rank]].clone().requires_grad_()
        probe = copy.deepcopy(layer)  # the reference comparison below reads `layer`'s running statistics
        with _forbid_host_reads() as host_reads:
            with contextlib.suppress(AssertionError):
                probe(chunk).backward(upstream[start:start + SPLITS[rank]])
        results["host_reads"] = host_reads
        results["running_mean"] = layer.running_mean.clone()
        results["running_var"] = layer.running_var.clone()
        results["num_batches_tracked"] = layer.num_batches_tracked.clone()

        # float32 inputs with mean 1e4 and std 1 still normalize to std 1
        big = SynchronizedBatchNorm2d(CHANNELS, affine=False)
        generator = torch.Generator().manual_seed(rank)
        results["large_mean_output"] = big(torch.randn(SPLITS[rank], CHANNELS, 8, 8, generator=generator) + 1e4)

        # the same layer inside DistributedDataParallel
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Conv2d(3, CHANNELS, 1).double(), initial_layer()))
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.5 + 1)
        x, upstream = global_batch(0)
        inputs = x[start:start + SPLITS[rank], :3]
        (model(inputs) * upstream[start:start + SPLITS[rank]]).sum().backward()
        results["ddp_grads"] = [p.grad.clone() for p in model.parameters()]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        del model
        gc.collect()  # DDP sits in reference cycles: a live DDP during destroy_process_group aborts gloo at exit
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(out_dir: Path) -> list[dict]:
    port = free_port()
    context = mp.start_processes(_worker, args=(port, str(out_dir)), nprocs=WORLD_SIZE, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"distributed workers did not finish within {TIMEOUT_S} s (hang)")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


@pytest.mark.slow
def test_two_gloo_ranks_equal_single_process_batchnorm(tmp_path):
    results = run_ranks(tmp_path)
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
