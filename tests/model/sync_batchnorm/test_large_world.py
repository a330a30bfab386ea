"""Synchronized BatchNorm at a large world size: 16 gloo processes on this machine (one thread each).

One spawn runs, in every process: a float64 step with uneven and empty shares against nn.BatchNorm2d on the
concatenated batch; float32 input with mean 1e4 against a float64 recomputation, float64 input with mean 1e6
against nn.BatchNorm2d; sync groups of 4 against
each group's own concatenated batch (what four independent 4-rank runs give: test_distributed.py shows a
run equals nn.BatchNorm on its batch); one rank calling a layer an extra time, named on every rank within
5 s; and one rank killed (SIGKILL) in the middle of an exchange, which ends every other rank within the
process group's timeout with the trainer's one-line "lost contact" message. The exchange is an all-reduce
whose size does not depend on the world size (issue 33); bytes are measured by
benchmarks/bench_syncbn_scale.py.
"""
from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.gloo import free_port, start_ranks

WORLD = 16
CHANNELS = 5
SHARES = [rank % 4 for rank in range(WORLD)]  # 0, 1, 2, 3, 0, ...: uneven, four processes with nothing
GROUP_SIZE = 4
TIMEOUT_S = 20  # the process group's timeout: a killed peer must end the others within it
KILLED, EXTRA = 13, 11


def batch(dtype=torch.float64, offset: float = 2.0, scale: float = 3.0, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SHARES), CHANNELS, 3, 4, generator=generator, dtype=torch.float64) * scale + offset
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    return x.to(dtype), upstream.to(dtype)


def share(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(SHARES[:rank])
    return tensor[start:start + SHARES[rank]]


def layer(cls, **kwargs) -> nn.Module:
    module = cls(CHANNELS, **kwargs).double()
    with torch.no_grad():
        module.weight.copy_(torch.linspace(0.5, 1.5, CHANNELS, dtype=torch.float64))
        module.bias.copy_(torch.linspace(-1, 1, CHANNELS, dtype=torch.float64))
    return module


def worker(rank: int, port: int, out_dir: str) -> None:
    from syncseg.engine.distributed import is_communication_error
    from syncseg.engine.launch_hints import lost_contact_message
    from syncseg.model.sync_batchnorm import SyncDivergenceError, SynchronizedBatchNorm2d, name_synchronized_layers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    results: dict = {}
    # the whole world, float64, uneven and empty shares
    x, upstream = batch()
    mine = share(x, rank).clone().requires_grad_()
    sync = layer(SynchronizedBatchNorm2d)
    y = sync(mine)
    y.backward(share(upstream, rank))
    results.update(y=y.detach(), dx=mine.grad, dweight=sync.weight.grad, dbias=sync.bias.grad,
                   running=torch.stack([sync.running_mean, sync.running_var]))
    # float32 input, mean 1e4 and std 1
    big, _ = batch(torch.float32, offset=1e4, scale=1.0, seed=6)
    results["big"] = SynchronizedBatchNorm2d(CHANNELS, affine=False)(share(big, rank)).detach()
    huge, _ = batch(offset=1e6, scale=1.0, seed=7)  # float64 input at mean/std 1e6: the exact two-round merge
    results["huge"] = SynchronizedBatchNorm2d(CHANNELS, affine=False).double()(share(huge, rank)).detach()
    # sync groups of GROUP_SIZE
    own_group, _ = dist.new_subgroups(group_size=GROUP_SIZE)
    grouped = layer(SynchronizedBatchNorm2d, process_group=own_group)
    mine = share(x, rank).clone().requires_grad_()
    grouped(mine).backward(share(upstream, rank))
    results.update(group_y=grouped(share(x, rank)).detach(), group_dx=mine.grad,
                   group_running=torch.stack([grouped.running_mean, grouped.running_var]))
    # one rank calls `stem` once more
    model = name_synchronized_layers(nn.ModuleDict({"stem": SynchronizedBatchNorm2d(3), "head": SynchronizedBatchNorm2d(3)}))
    start = time.monotonic()
    try:
        h = model["stem"](torch.randn(2, 3, 4, 4))
        if rank == EXTRA:
            h = model["stem"](h)
        model["head"](h)
        results["divergence"] = "no error"
    except SyncDivergenceError as error:
        results["divergence"] = str(error)
    results["divergence_seconds"] = time.monotonic() - start
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()

    # a killed peer: KILLED dies on its way into an exchange, the others are in it
    victim = SynchronizedBatchNorm2d(3)
    if rank == KILLED:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(3):
            victim(torch.randn(2, 3, 4, 4))
        outcome = "no error"
    except Exception as error:  # noqa: BLE001 - what the trainer would classify
        outcome = (lost_contact_message(error, rank=rank, timeout_s=TIMEOUT_S, launcher="torchrun")
                   if is_communication_error(error) else f"unclassified: {type(error).__name__}: {error}")
    Path(out_dir, f"killed{rank}.txt").write_text(f"{time.monotonic() - start:.2f}\n{outcome}")
    os._exit(0)  # the group is broken: tearing it down could wait on the dead peer


@pytest.mark.slow
def test_sixteen_gloo_processes_equal_batchnorm_name_a_divergence_and_end_on_a_killed_peer(tmp_path):
    port = free_port()
    started = time.monotonic()
    context = start_ranks(worker, (port, str(tmp_path)), WORLD, join=False)
    deadline = started + 240
    while any(process.is_alive() for process in context.processes):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("16 gloo processes did not finish within 240 s")
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    assert context.processes[KILLED].exitcode == -signal.SIGKILL
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]

    tol = dict(rtol=1e-10, atol=1e-10)
    x, upstream = batch()
    reference = layer(nn.BatchNorm2d)
    x = x.clone().requires_grad_()
    expected_y = reference(x)
    expected_y.backward(upstream)
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), expected_y.detach(), **tol)
    torch.testing.assert_close(torch.cat([r["dx"] for r in results]), x.grad, **tol)
    assert x.grad.abs().max() > 1e-3
    summed = torch.stack([torch.stack([r["dweight"], r["dbias"]]) for r in results]).sum(0)
    torch.testing.assert_close(summed, torch.stack([reference.weight.grad, reference.bias.grad]), **tol)
    for r in results:
        torch.testing.assert_close(r["running"], torch.stack([reference.running_mean, reference.running_var]), **tol)

    big, _ = batch(torch.float32, offset=1e4, scale=1.0, seed=6)
    big64 = big.double()
    mean, var = big64.mean((0, 2, 3), keepdim=True), big64.var((0, 2, 3), unbiased=False, keepdim=True)
    torch.testing.assert_close(torch.cat([r["big"] for r in results]).double(), (big64 - mean) / (var + 1e-5).sqrt(),
                               rtol=0, atol=2e-3)  # float32 input at mean/std 1e4: its own rounding, 1e4 * 6e-8

    huge, _ = batch(offset=1e6, scale=1.0, seed=7)
    torch.testing.assert_close(torch.cat([r["huge"] for r in results]),
                               nn.BatchNorm2d(CHANNELS, affine=False).double()(huge), rtol=0, atol=1e-9)

    for group in range(WORLD // GROUP_SIZE):
        ranks = range(group * GROUP_SIZE, (group + 1) * GROUP_SIZE)
        start, stop = sum(SHARES[:ranks[0]]), sum(SHARES[:ranks[-1] + 1])
        part = x.detach()[start:stop].clone().requires_grad_()
        own = layer(nn.BatchNorm2d)
        own(part).backward(upstream[start:stop])
        torch.testing.assert_close(torch.cat([results[r]["group_dx"] for r in ranks]), part.grad, **tol)
        torch.testing.assert_close(torch.cat([results[r]["group_y"] for r in ranks]), own(part.detach()), **tol)
        for r in ranks:
            torch.testing.assert_close(results[r]["group_running"], torch.stack([own.running_mean, own.running_var]),
                                       **tol)

    messages = {r["divergence"] for r in results}
    assert len(messages) == 1, messages  # one message, on every rank
    message = messages.pop()
    assert f"the 15 ranks other than rank {EXTRA} called 'head' (call 1) but rank {EXTRA} called 'stem' (call 2)" \
        in message, message
    assert max(r["divergence_seconds"] for r in results) < 5

    for rank in range(WORLD):
        if rank == KILLED:
            continue
        seconds, outcome = Path(tmp_path, f"killed{rank}.txt").read_text().split("\n", 1)
        assert float(seconds) < TIMEOUT_S + 5, (rank, seconds, outcome)
        assert outcome.startswith(f"rank {rank}: lost contact with the other processes") and "\n" not in outcome, \
            (rank, outcome)
    print(f"16 gloo processes: {elapsed:.0f} s, spawn to exit")
