"""Speed and memory of SynchronizedBatchNorm2d against the built-in BatchNorm, same run, paired ratios.

    python -m benchmarks.bench_syncbn [--repeats 60] [--device cpu|cuda] [--output results.json]

a. one device: SynchronizedBatchNorm2d vs nn.BatchNorm2d (forward + backward), time and the bytes of
   tensors saved for backward. Target <= 1.03 (it is the same kernel).
b. the synchronized code path with communication stubbed out (one replica merges its own statistics):
   time and saved bytes vs F.batch_norm in training mode. Targets: time <= 1.5x, saved bytes <= 1.1x.
c. 2 gloo ranks (CPU, separate processes): (synchronized layer time - local nn.BatchNorm2d time) /
   (time of the bare collectives the layer needs: one all_reduce of 2C+7 float64 values in forward
   (count, the sums of means and second moments, the divergence label: functions.reduce_over_group),
   one all_reduce of 2C values in backward; a sample is the median of 32 individually timed pairs,
   since gloo's loopback latency is bimodal). Target <= 2. Beside it, reported without a verdict
   (no issue sets a target for it), "c in place": the same numerator over the time those collectives
   add when they run inside a local BN step at the layer's places (after the forward, after the
   backward), where each also waits for the slower rank. It is a difference of two noisy
   differences (its pairs spread over 1-4), so across runs it straddles 2.

Every variant runs forward + backward with a random upstream gradient. Variants are interleaved
in each repetition (so machine noise hits them alike); medians of per-repetition ratios are reported
with their spread, beside an A/A control (the denominator against an identical copy of itself): a
verdict needs the control within 1.02 (benchmarks/common.py). Saved bytes count each storage once
(the synchronized path saves its input from two graph nodes, which is one tensor in memory). The
benchmark re-executes itself with the stable allocator setting (BENCH_DEFAULT_ALLOCATOR=1: glibc
defaults); the setting is printed and recorded.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from benchmarks.common import environment, judge, paired, print_targets, stable_allocator, summary, time_interleaved
from benchmarks.common import write_record
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

SHAPES = [(8, 64, 128, 128), (4, 256, 65, 65), (16, 512, 33, 33)]
COMM_PASSES = 32


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


def layer_inputs(shape, device, dtype):
    """One input (requiring grad), its upstream gradient, and nn.BatchNorm2d twice (reference, A/A twin)."""
    channels = shape[1]
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) * 2 + 1).to(device, dtype).requires_grad_()
    upstream = torch.randn(shape, generator=generator).to(device, dtype)
    return x, upstream, nn.BatchNorm2d(channels).to(device), nn.BatchNorm2d(channels).to(device)


def make_steps(shape, device, dtype):
    """Forward + backward closures over one input; "... copy" variants are identical twins (A/A controls)."""
    channels = shape[1]
    x, upstream, builtin, builtin_copy = layer_inputs(shape, device, dtype)
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

    def functional():
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, 0.1, 1e-5)

    return {
        "nn.BatchNorm2d": lambda backward=True: run(lambda: builtin(x), backward),
        "nn.BatchNorm2d copy": lambda backward=True: run(lambda: builtin_copy(x), backward),
        "SyncBN2d one device": lambda backward=True: run(lambda: sync(x), backward),
        "F.batch_norm train": lambda backward=True: run(functional, backward),
        "F.batch_norm train copy": lambda backward=True: run(functional, backward),
        "SyncBN2d sync path (stubbed)": lambda backward=True: run(
            lambda: sync._forward_synchronized(x, None, 0.1, sync.running_mean, sync.running_var), backward),
    }


def single_process_benchmarks(repeats: int, device: torch.device) -> tuple[list[dict], list[dict]]:
    rows, targets = [], []
    sync_device = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    for shape in SHAPES:
        steps = make_steps(shape, device, torch.float32)
        times = time_interleaved(steps, repeats, inner=2, before=sync_device, after=sync_device)
        memory = {name: saved_bytes(steps[name]) for name in steps}
        row = {
            "shape": list(shape),
            "median_ms": {name: 1000 * statistics.median(t) for name, t in times.items()},
            "saved": memory,
            "a": paired(times["SyncBN2d one device"], times["nn.BatchNorm2d"]),
            "a_control": paired(times["nn.BatchNorm2d copy"], times["nn.BatchNorm2d"]),
            "a_saved_ratio": memory["SyncBN2d one device"]["unique_bytes"] / memory["nn.BatchNorm2d"]["unique_bytes"],
            "b": paired(times["SyncBN2d sync path (stubbed)"], times["F.batch_norm train"]),
            "b_control": paired(times["F.batch_norm train copy"], times["F.batch_norm train"]),
            "b_saved_ratio": memory["SyncBN2d sync path (stubbed)"]["unique_bytes"]
            / memory["F.batch_norm train"]["unique_bytes"],
        }
        rows.append(row)
        label = "x".join(map(str, shape))
        targets += [
            judge(f"syncbn a time {label}", row["a"], target=1.03, control=row["a_control"]),
            judge(f"syncbn a saved bytes {label}", {"median": row["a_saved_ratio"]}, target=1.0, control=None),
            judge(f"syncbn b time {label}", row["b"], target=1.5, control=row["b_control"]),
            judge(f"syncbn b saved bytes {label}", {"median": row["b_saved_ratio"]}, target=1.1, control=None),
        ]
    return rows, targets


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
        local, local_copy = nn.BatchNorm2d(channels), nn.BatchNorm2d(channels)
        # count, sums of n * mean and M2 + n * mean^2, six label sums (zeros: summing them again and again
        # changes nothing)
        stats_row = torch.zeros(2 * channels + 7, dtype=torch.float64)
        reduce_row = torch.randn(2, channels)

        def layer_step(module):
            x.grad = None
            module(x).backward(upstream)

        pair_medians: dict[str, list[float]] = {"comm": [], "comm copy": []}
        pair_means: dict[str, list[float]] = {"comm": [], "comm copy": []}

        def collectives(name):
            # One sample = COMM_PASSES pairs, each timed. gloo's latency on loopback is bimodal (all_reduce:
            # ~0.5 ms, or ~4 ms in one call in five to three), so a mean of 32 pairs swings +-20% from sample
            # to sample; the sample's median pair swings less, and it is what the numerator's median of
            # single steps mostly sees. The mix also drifts over seconds, which no estimator removed: on
            # this 2-core VM the comm A/A control still reads 0.87-1.06. The mean is recorded beside it.
            def run():
                pairs = []
                for _ in range(COMM_PASSES):
                    start = time.perf_counter()
                    dist.all_reduce(stats_row)
                    dist.all_reduce(reduce_row)
                    pairs.append(time.perf_counter() - start)
                pair_medians[name].append(statistics.median(pairs))
                pair_means[name].append(statistics.fmean(pairs))
            return run

        def local_with_collectives():
            # the same two collectives at the same places as in the synchronized layer (after the forward's
            # statistics, after the backward's sums), so they also wait for the slower rank
            x.grad = None
            y = local(x)
            dist.all_reduce(stats_row)
            y.backward(upstream)
            dist.all_reduce(reduce_row)

        variants = {"sync": lambda: layer_step(sync), "local": lambda: layer_step(local),
                    "local copy": lambda: layer_step(local_copy), "comm": collectives("comm"),
                    "comm copy": collectives("comm copy"), "local + collectives": local_with_collectives}
        times = time_interleaved(variants, repeats, before=dist.barrier)
        for name in ("comm", "comm copy"):  # the sample's median pair, not its total (the warm-up left out)
            times[name] = pair_medians[name][-repeats:]
            pair_means[name] = pair_means[name][-repeats:]
        extra = [s - l for s, l in zip(times["sync"], times["local"])]
        extra_median = statistics.median(extra)
        in_place = [c - l for c, l in zip(times["local + collectives"], times["local"])]
        rows.append({
            "shape": list(shape),
            "per_rank_shape": list(local_shape),
            "ms": {name: summary(t, 1000) for name, t in times.items()},
            "extra_ms": summary(extra, 1000),
            "extra_fraction_of_local": extra_median / statistics.median(times["local"]),
            "c": {"median": extra_median / statistics.median(times["comm"]),
                  **{key: value for key, value in paired(extra, times["comm"]).items() if key != "median"}},
            "collectives_in_place_ms": summary(in_place, 1000),
            "c_in_place": {"median": extra_median / statistics.median(in_place),
                           **{key: value for key, value in paired(extra, in_place).items() if key != "median"}},
            "comm_mean_pair_ms": summary(pair_means["comm"], 1000),
            "local_control": paired(times["local copy"], times["local"]),
            "comm_control": paired(times["comm copy"], times["comm"]),
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
    parser.add_argument("--repeats", type=int, default=60,
                        help="interleaved repetitions of every variant (6 make one balanced cycle)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the 2-rank part runs on gloo, CPU)")
    parser.add_argument("--skip-distributed", action="store_true", help="leave out part c (2 gloo processes)")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/bench_syncbn.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device=str(device), repeats=args.repeats)
    print(f"torch {env['torch']} on {device}, {env['torch_threads']} threads, {args.repeats} interleaved "
          f"repetitions; allocator: {env['allocator']}")
    rows, targets = single_process_benchmarks(args.repeats, device)
    header = (f"{'shape':>18} | {'nn.BN ms':>9} {'SyncBN ms':>9} {'a time':>7} {'A/A':>6} {'a mem':>6} | "
              f"{'F.bn ms':>8} {'sync ms':>8} {'b time':>7} {'A/A':>6} {'b mem':>6}")
    print(header)
    print("-" * len(header))
    for row in rows:
        ms = row["median_ms"]
        print(f"{str(tuple(row['shape'])):>18} | {ms['nn.BatchNorm2d']:9.2f} {ms['SyncBN2d one device']:9.2f} "
              f"{row['a']['median']:7.3f} {row['a_control']['median']:6.3f} {row['a_saved_ratio']:6.2f} | "
              f"{ms['F.batch_norm train']:8.2f} {ms['SyncBN2d sync path (stubbed)']:8.2f} "
              f"{row['b']['median']:7.3f} {row['b_control']['median']:6.3f} {row['b_saved_ratio']:6.2f}")
    print("targets: a time <= 1.03, a saved bytes <= 1.0; b time <= 1.5, b saved bytes <= 1.1 "
          "(A/A: the denominator against its twin)")

    distributed_rows = []
    if not args.skip_distributed and dist.is_available() and device.type == "cpu":
        threads = max(1, (os.cpu_count() or 2) // 2)
        distributed_rows = two_rank_benchmark(args.repeats, threads)
        print(f"\n2 gloo ranks on CPU ({threads} thread(s) each), batch split in half; ms are medians (IQR):")
        header = (f"{'shape':>18} | {'local ms':>14} {'extra ms':>14} {'of local':>8} | {'comm ms':>14} {'mean':>5} | "
                  f"{'c':>6} {'A/A local':>9} {'A/A comm':>8} | {'in place ms':>14} {'c in place':>10}")
        print(header)
        print("-" * len(header))
        for row in distributed_rows:
            def cell(stats):
                return f"{stats['median']:5.2f} ({stats['q1']:.2f}-{stats['q3']:.2f})"

            print(f"{str(tuple(row['shape'])):>18} | {cell(row['ms']['local']):>14} {cell(row['extra_ms']):>14} "
                  f"{100 * row['extra_fraction_of_local']:7.1f}% | {cell(row['ms']['comm']):>14} "
                  f"{row['comm_mean_pair_ms']['median']:5.2f} | "
                  f"{row['c']['median']:6.2f} {row['local_control']['median']:9.3f} "
                  f"{row['comm_control']['median']:8.3f} | {cell(row['collectives_in_place_ms']):>14} "
                  f"{row['c_in_place']['median']:10.2f}")
            worse = max((row["local_control"], row["comm_control"]), key=lambda c: abs(c["median"] - 1))
            label = "x".join(map(str, row["shape"]))
            targets.append(judge(f"syncbn c {label}", row["c"], target=2.0, control=worse))
        print("comm ms: median over samples of each sample's median pair (forward all_reduce + backward all_reduce); mean: the same "
              "with each sample's mean pair (gloo's slow mode included)")
        print("target: c = median(sync - local) / median(bare collectives) <= 2; 'c in place' (no verdict): the "
              "same numerator over the collectives run inside a local BN step (after its forward, after its "
              "backward), where they also wait for the slower rank")

    print_targets(targets)
    write_record("bench_syncbn", args.output, {"environment": env, "single_process": rows,
                                                "two_gloo_ranks": distributed_rows, "targets": targets})


if __name__ == "__main__":
    stable_allocator("benchmarks.bench_syncbn", sys.argv[1:])  # re-executes once, when run as a program
    main()
