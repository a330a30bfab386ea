"""Speed and memory of SynchronizedBatchNorm2d against the built-in BatchNorm, same run, paired ratios.

    python -m benchmarks.bench_syncbn [--repeats 15] [--device cpu|cuda] [--output results.json]

a. one device: SynchronizedBatchNorm2d vs nn.BatchNorm2d (forward + backward), time and the bytes of
   tensors saved for backward. Target <= 1.03 (it is the same kernel).
b. the synchronized code path with communication stubbed out (one replica merges its own statistics):
   time and saved bytes vs F.batch_norm in training mode. Targets: time <= 1.5x, saved bytes <= 1.1x.
c. 2 gloo ranks (CPU, separate processes): (synchronized layer time - local nn.BatchNorm2d time) /
   (time of the bare collectives the layer needs: one all_gather of 2C+1 float64 values in forward,
   one all_reduce of 2C values in backward). Target <= 2.

Every variant runs forward + backward with a random upstream gradient. Variants are interleaved
in each repetition (so machine noise hits them alike); medians of per-repetition ratios are reported.
Saved bytes count each storage once (the synchronized path saves its input from two graph nodes,
which is one tensor in memory). The allocator settings in effect are printed and recorded.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from model.sync_batchnorm import SynchronizedBatchNorm2d

SHAPES = [(8, 64, 128, 128), (4, 256, 65, 65), (16, 512, 33, 33)]
ALLOCATOR_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD",
                       "PYTORCH_CUDA_ALLOC_CONF")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_bytes(step) -> dict:
    """Bytes of the tensors autograd saves during `step()` (each storage once), and the raw count."""
    storages: dict[tuple, int] = {}
    packed = [0, 0]

    def pack(tensor: torch.Tensor):
        packed[0] += 1
        packed[1] += tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        storages[(storage.data_ptr(), tensor.device)] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(backward=False)
    return {"unique_bytes": sum(storages.values()), "packed_tensors": packed[0], "packed_bytes": packed[1]}


def make_steps(shape, device, dtype):
    channels = shape[1]
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) * 2 + 1).to(device, dtype).requires_grad_()
    upstream = torch.randn(shape, generator=generator).to(device, dtype)
    builtin = nn.BatchNorm2d(channels).to(device)
    sync = SynchronizedBatchNorm2d(channels).to(device)
    weight = torch.ones(channels, device=device, requires_grad=True)
    bias = torch.zeros(channels, device=device, requires_grad=True)
    running_mean = torch.zeros(channels, device=device)
    running_var = torch.ones(channels, device=device)

    def run(forward, backward=True):
        x.grad = None
        y = forward()
        if backward:
            y.backward(upstream)
        return y

    return {
        "nn.BatchNorm2d": lambda backward=True: run(lambda: builtin(x), backward),
        "SyncBN2d one device": lambda backward=True: run(lambda: sync(x), backward),
        "F.batch_norm train": lambda backward=True: run(
            lambda: F.batch_norm(x, running_mean, running_var, weight, bias, True, 0.1, 1e-5), backward),
        "SyncBN2d sync path (stubbed)": lambda backward=True: run(
            lambda: sync._forward_synchronized(x, None, 0.1, sync.running_mean, sync.running_var), backward),
    }


def time_interleaved(steps: dict, names: list[str], repeats: int, device) -> dict[str, list[float]]:
    for name in names:  # warm-up
        steps[name]()
    synchronize(device)
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            synchronize(device)
            start = time.perf_counter()
            steps[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def single_process_benchmarks(repeats: int, device: torch.device) -> list[dict]:
    rows = []
    for shape in SHAPES:
        steps = make_steps(shape, device, torch.float32)
        names = list(steps)
        times = time_interleaved(steps, names, repeats, device)
        memory = {name: saved_bytes(steps[name]) for name in names}
        rows.append({
            "shape": list(shape),
            "median_ms": {name: 1000 * statistics.median(t) for name, t in times.items()},
            "saved": memory,
            "a_time_ratio": paired_ratio(times, "SyncBN2d one device", "nn.BatchNorm2d"),
            "a_saved_ratio": memory["SyncBN2d one device"]["unique_bytes"] / memory["nn.BatchNorm2d"]["unique_bytes"],
            "b_time_ratio": paired_ratio(times, "SyncBN2d sync path (stubbed)", "F.batch_norm train"),
            "b_saved_ratio": memory["SyncBN2d sync path (stubbed)"]["unique_bytes"]
            / memory["F.batch_norm train"]["unique_bytes"],
        })
    return rows


# ----------------------------------------------------------------------------------------------
# c. two gloo ranks
# ----------------------------------------------------------------------------------------------
def _rank_worker(rank: int, port: int, repeats: int, out_path: str, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    rows = []
    for shape in SHAPES:
        local_shape = (shape[0] // 2, *shape[1:])
        channels = shape[1]
        generator = torch.Generator().manual_seed(rank)
        x = (torch.randn(local_shape, generator=generator) + 1).requires_grad_()
        upstream = torch.randn(local_shape, generator=generator)
        sync = SynchronizedBatchNorm2d(channels)
        local = nn.BatchNorm2d(channels)
        gather_row = torch.randn(2 * channels + 1, dtype=torch.float64)
        gather_out = [torch.empty_like(gather_row) for _ in range(2)]
        reduce_row = torch.randn(2, channels)

        def layer_step(module):
            x.grad = None
            module(x).backward(upstream)

        def collectives():
            dist.all_gather(gather_out, gather_row)
            dist.all_reduce(reduce_row)

        variants = {"sync": lambda: layer_step(sync), "local": lambda: layer_step(local), "comm": collectives}
        for step in variants.values():
            step()
        times = {name: [] for name in variants}
        for _ in range(repeats):
            for name, step in variants.items():
                dist.barrier()
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        overhead = [s - l for s, l in zip(times["sync"], times["local"])]
        rows.append({
            "shape": list(shape),
            "per_rank_shape": list(local_shape),
            "median_ms": {name: 1000 * statistics.median(t) for name, t in times.items()},
            "median_overhead_ms": 1000 * statistics.median(overhead),
            "c_ratio": statistics.median(overhead) / statistics.median(times["comm"]),
        })
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def two_rank_benchmark(repeats: int, threads: int) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_syncbn_ranks_{os.getpid()}.json"
    mp.start_processes(_rank_worker, args=(port, repeats, str(out_path), threads), nprocs=2, start_method="spawn")
    rows = json.loads(out_path.read_text())
    out_path.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repetitions of every variant")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the 2-rank part runs on gloo, CPU)")
    parser.add_argument("--skip-distributed", action="store_true", help="leave out part c (2 gloo processes)")
    parser.add_argument("--output", default=str(Path(__file__).resolve().parent / "results" / "bench_syncbn.json"),
                        help="JSON results file")
    args = parser.parse_args()
    device = torch.device(args.device)

    environment = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device),
        "allocator_env": {name: os.environ.get(name) for name in ALLOCATOR_VARIABLES},
        "allocator": "glibc malloc defaults (large freed blocks return to the OS)"
        if device.type == "cpu" and not os.environ.get("LD_PRELOAD") else "see allocator_env",
        "repeats": args.repeats,
    }
    print(f"torch {environment['torch']} on {device}, {environment['torch_threads']} threads, "
          f"{args.repeats} interleaved repetitions; allocator: {environment['allocator']}")
    rows = single_process_benchmarks(args.repeats, device)
    header = (f"{'shape':>18} | {'nn.BN ms':>9} {'SyncBN ms':>9} {'a time':>7} {'a mem':>6} | "
              f"{'F.bn ms':>8} {'sync ms':>8} {'b time':>7} {'b mem':>6}")
    print(header)
    print("-" * len(header))
    for row in rows:
        ms = row["median_ms"]
        print(f"{str(tuple(row['shape'])):>18} | {ms['nn.BatchNorm2d']:9.2f} {ms['SyncBN2d one device']:9.2f} "
              f"{row['a_time_ratio']:7.3f} {row['a_saved_ratio']:6.2f} | {ms['F.batch_norm train']:8.2f} "
              f"{ms['SyncBN2d sync path (stubbed)']:8.2f} {row['b_time_ratio']:7.3f} {row['b_saved_ratio']:6.2f}")
    print("targets: a time <= 1.03; b time <= 1.5, b saved bytes <= 1.1")

    distributed_rows = []
    if not args.skip_distributed and dist.is_available():
        threads = max(1, (os.cpu_count() or 2) // 2)
        distributed_rows = two_rank_benchmark(args.repeats, threads)
        print(f"\n2 gloo ranks on CPU ({threads} thread(s) each), batch split in half:")
        header = f"{'shape':>18} | {'sync ms':>8} {'local ms':>8} {'comm ms':>8} {'overhead':>8} {'c ratio':>7}"
        print(header)
        print("-" * len(header))
        for row in distributed_rows:
            ms = row["median_ms"]
            print(f"{str(tuple(row['shape'])):>18} | {ms['sync']:8.2f} {ms['local']:8.2f} {ms['comm']:8.3f} "
                  f"{row['median_overhead_ms']:8.2f} {row['c_ratio']:7.2f}")
        print("target: c ratio <= 2 ((sync - local) / bare collectives)")

    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"environment": environment, "single_process": rows,
                                  "two_gloo_ranks": distributed_rows}, indent=2))
    print(f"\nwrote {output}")


if __name__ == "__main__":
    main()
