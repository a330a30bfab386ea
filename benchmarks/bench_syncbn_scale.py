"""What synchronized BatchNorm's statistics exchange costs as the world grows, simulated with gloo processes.

    python -m benchmarks.bench_syncbn_scale [--worlds 2,4,8,16] [--repeats 30] [--output results.json]

For each world size W, W gloo processes on this machine (one thread each) run the forward statistics
exchange of LAYERS (synchronized layers of DeepLab's widths) once per "step", three ways, interleaved:

* old: the exchange syncseg had before issue 33: every process all-gathers one float64 row of 2C+3 values
  (count, mean, M2, the divergence label) and merges the W rows (Chan's formula);
* new: `functions.reduce_over_group`, what the layer runs now: one all-reduce of 2C+7 float64 sums
  (count, n*mean, M2 + n*mean^2, six label sums) for float32 statistics; float64 input adds a second
  all-reduce of C values (exact Chan merge), shown in the bytes table as "new, float64";
* torch: what torch.nn.SyncBatchNorm's forward exchanges: an all_gather_into_tensor of 2C+1 float32 values
  (mean, invstd, count) per process, merged by torch.batch_norm_gather_stats_with_counts (a copy of its
  exchange: the layer itself refuses CPU tensors);
* new copy: the new exchange again, the A/A control of the timing.

Bytes per process and step are counted from the collectives' sizes while the layers run (a wrapper
around torch.distributed's all_reduce / all_gather / all_gather_into_tensor notes each call's tensors):
"sent" is what a process hands to the collective, "received" what the collective hands back (an
all-gather's whole output, an all-reduce's summed tensor). On the wire a ring all-reduce moves
2(W-1)/W times its tensor each way (at most twice, whatever W) and a ring all-gather (W-1)/W of its
output; the table prints that model beside the counted sizes. Then the same counts, on paper, for
DeepLabV3+ on ResNet-101 (its synchronized layers counted from the model) at 64, 512 and 4096 processes.

Targets: the new exchange's received bytes per process flat in W (largest / smallest <= 1.01); its time
at the largest W no worse than the old exchange's at 2 processes (a ratio across runs: each run's A/A
control must hold). W processes share this machine's cores, so time at large W mostly measures the
scheduler; the bytes are the portable figure.
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

from benchmarks.common import environment, judge, paired, print_targets, stable_allocator, summary, time_interleaved
from benchmarks.common import write_record

LAYERS = (256, 256, 512, 1024, 2048)  # a few synchronized layers of DeepLab/ResNet widths
F64 = 8
PASSES = 8  # steps per sample


class CollectiveCounter:
    """Wraps torch.distributed's collectives and adds each call's bytes to `sent` / `received`."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor")

    def __init__(self) -> None:
        self.sent = self.received = 0
        self.wire = 0.0  # ring model: bytes received on the wire
        self._saved: dict = {}

    def __enter__(self) -> "CollectiveCounter":
        world = dist.get_world_size()

        def wrap(name, original):
            def counted(*args, **kwargs):
                if name == "all_reduce":
                    size = _nbytes(args[0])
                    self.sent += size
                    self.received += size
                    self.wire += 2 * (world - 1) / world * size
                elif name == "all_gather":
                    output, tensor = args[0], args[1]
                    self.sent += _nbytes(tensor)
                    self.received += sum(_nbytes(t) for t in output)
                    self.wire += (world - 1) * _nbytes(tensor)
                else:
                    output, tensor = args[0], args[1]
                    self.sent += _nbytes(tensor)
                    self.received += _nbytes(output)
                    self.wire += (world - 1) * _nbytes(tensor)
                return original(*args, **kwargs)
            return counted

        for name in self.NAMES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def old_exchange(count: int, mean: torch.Tensor, m2: torch.Tensor, label: tuple[int, int]):
    """The pre-issue-33 forward exchange: all-gather of (count, mean, M2, key, call) rows, Chan's merge."""
    from syncseg.model.sync_batchnorm import functions

    row = torch.cat([mean.new_full((1,), float(count)), mean, m2, mean.new_tensor([float(label[0]), float(label[1])])])
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    gathered = torch.stack(rows)
    channels = mean.numel()
    return functions._merge(gathered[:, 0], gathered[:, 1:1 + channels], gathered[:, 1 + channels:1 + 2 * channels])


def new_exchange(count: int, mean: torch.Tensor, m2: torch.Tensor, label: tuple[int, int], exact: bool = False):
    from syncseg.model.sync_batchnorm import functions

    group = dist.group.WORLD
    return functions.reduce_over_group(count, mean, m2, functions.label_tensor(mean, *label, group), exact,
                                       functions._eager_all_reduce(group))


def torch_exchange(count: int, mean32: torch.Tensor, invstd32: torch.Tensor, eps: float = 1e-5):
    """torch.nn.SyncBatchNorm's forward exchange (torch/nn/modules/_functions.py): one all_gather_into_tensor
    of [mean, invstd, count] in float32, then the merge batch_norm_gather_stats_with_counts does (a CUDA
    kernel only; written out here in float32 tensor ops)."""
    combined = torch.cat([mean32, invstd32, mean32.new_full((1,), float(count))])
    world = dist.get_world_size()
    gathered = torch.empty(world * combined.numel(), dtype=combined.dtype)
    dist.all_gather_into_tensor(gathered, combined)
    gathered = gathered.view(world, -1)
    channels = mean32.numel()
    means, invstds, counts = gathered[:, :channels], gathered[:, channels:2 * channels], gathered[:, -1:]
    total = counts.sum()
    mean = (means * counts).sum(0) / total
    var = ((invstds.pow(-2) - eps + (means - mean).square()) * counts).sum(0) / total
    return mean, torch.rsqrt(var + eps)


def _worker(rank: int, world: int, port: int, repeats: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

    generator = torch.Generator().manual_seed(rank)
    count = 2 * 17 * 17  # two 17x17 crops' worth of values per channel and process (any value would do)
    stats = []
    for channels in LAYERS:
        mean = torch.randn(channels, generator=generator, dtype=torch.float64) + 3
        m2 = torch.rand(channels, generator=generator, dtype=torch.float64) * count
        stats.append((mean, m2, mean.float(), torch.rsqrt(m2 / count + 1e-5).float()))

    def step(kind: str):
        def run():
            for index, (mean, m2, mean32, invstd32) in enumerate(stats):
                if kind == "old":
                    old_exchange(count, mean, m2, (12345, index))
                elif kind == "torch":
                    torch_exchange(count, mean32, invstd32)
                else:
                    new_exchange(count, mean, m2, (12345, index), exact=kind == "new float64")
        return run

    # bytes, counted from the real layers' collectives (forward only: the backward is one all_reduce of 2C
    # values in syncseg and torch alike)
    byte_counts = {}
    x_shape = lambda c: (2, c, 4, 4)  # noqa: E731
    for kind in ("new", "new float64"):
        counter = CollectiveCounter()
        dtype = torch.float64 if kind == "new float64" else torch.float32
        layers = [SynchronizedBatchNorm2d(c).to(dtype) for c in LAYERS]
        inputs = [torch.randn(x_shape(c), generator=generator, dtype=dtype) for c in LAYERS]
        with counter:
            for layer, x in zip(layers, inputs):
                layer(x)
        byte_counts[kind] = {"sent": counter.sent, "received": counter.received, "wire": counter.wire}
    # torch.nn.SyncBatchNorm refuses CPU tensors: its exchange is counted from the copy of its collective
    for kind in ("old", "torch"):
        counter = CollectiveCounter()
        with counter:
            step(kind)()
        byte_counts[kind] = {"sent": counter.sent, "received": counter.received, "wire": counter.wire}

    # A sample is PASSES steps, each timed: gloo's loopback latency is bimodal (a call in a few takes several
    # times the others), so the sample records its median step and, beside it, its mean step.
    medians: dict[str, list[float]] = {}
    means: dict[str, list[float]] = {}

    def sampled(name: str, kind: str):
        run = step(kind)

        def sample():
            steps = []
            for _ in range(PASSES):
                start = time.perf_counter()
                run()
                steps.append(time.perf_counter() - start)
            medians.setdefault(name, []).append(statistics.median(steps))
            means.setdefault(name, []).append(statistics.fmean(steps))
        return sample

    variants = {name: sampled(name, name.replace(" copy", "")) for name in ("old", "new", "torch", "new copy")}
    time_interleaved(variants, repeats, before=dist.barrier, warmup=1)
    if rank == 0:
        times = {name: values[-repeats:] for name, values in medians.items()}
        mean_times = {name: values[-repeats:] for name, values in means.items()}
        Path(out_path).write_text(json.dumps({"bytes": byte_counts, "times": times, "mean_times": mean_times}))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, repeats: int) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_syncbn_scale_{os.getpid()}_{world}.json"
    start = time.monotonic()
    mp.start_processes(_worker, args=(world, port, repeats, str(out_path)), nprocs=world, start_method="spawn")
    result = json.loads(out_path.read_text())
    out_path.unlink()
    result["seconds"] = time.monotonic() - start
    return result


def deeplab_layers() -> list[int]:
    """The widths of DeepLabV3+ / ResNet-101's synchronized layers (no weights are loaded)."""
    from syncseg.api import build_model

    model = build_model(arch="deeplabv3plus", backbone="resnet101", num_classes=21, norm="syncbn")
    return [module.num_features for module in model.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]


def on_paper(widths: list[int], worlds=(64, 512, 4096)) -> list[dict]:
    """Bytes per process and step of each forward exchange, from the formulas the counts above confirm."""
    rows = []
    for world in worlds:
        rows.append({
            "world": world,
            "old_received": sum(world * (2 * c + 3) * F64 for c in widths),
            "new_received": sum((2 * c + 7) * F64 for c in widths),
            "new_wire": sum(2 * (world - 1) / world * (2 * c + 7) * F64 for c in widths),
            "torch_received": sum(world * (2 * c + 1) * 4 for c in widths),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4,8,16", help="comma-separated world sizes")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repetitions of every variant")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/bench_syncbn_scale.json)")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    env = environment(worlds=worlds, repeats=args.repeats, layers=list(LAYERS))
    print(f"torch {env['torch']}, {env['cpu_count']} CPUs, gloo on loopback, one thread per process; layers of "
          f"{', '.join(map(str, LAYERS))} channels; allocator: {env['allocator']}")
    results = {}
    for world in worlds:
        results[world] = run_world(world, args.repeats)
        print(f"  {world} processes: {results[world]['seconds']:.0f} s", flush=True)

    print("\nbytes per process and step, forward statistics exchange of the layers above "
          "(counted from the collectives' sizes; ring: the wire model, received)")
    kinds = ("old", "new", "new float64", "torch")
    print(f"{'W':>4}  " + "  ".join(f"{kind + ' sent':>15}  {kind + ' recv':>15}  {kind + ' ring':>15}" for kind in kinds))
    for world, result in results.items():
        cells = []
        for kind in kinds:
            b = result["bytes"][kind]
            cells.append(f"{b['sent']:15,d}  {b['received']:15,d}  {b['wire']:15,.0f}")
        print(f"{world:>4}  " + "  ".join(cells))

    print(f"\nexchange time per step (ms; rank 0): median over repetitions of each sample's median of {PASSES} steps; "
          "'mean': the same with each sample's mean step (gloo's slow calls included)")
    print(f"{'W':>4}  {'old':>8}  {'new':>8}  {'torch':>8}  {'new/old':>8}  {'A/A':>6}  {'old mean':>8}  {'new mean':>8}  "
          f"{'torch mean':>10}")
    rows = []
    for world, result in results.items():
        times = result["times"]
        ratio = paired(times["new"], times["old"])
        control = paired(times["new copy"], times["new"])
        row = {"world": world, "ms": {k: summary(v, 1000) for k, v in times.items()}, "new_over_old": ratio,
               "control": control, "bytes": result["bytes"], "seconds": result["seconds"]}
        rows.append(row)
        row["mean_ms"] = {k: summary(v, 1000) for k, v in result["mean_times"].items()}
        print(f"{world:>4}  {row['ms']['old']['median']:8.3f}  {row['ms']['new']['median']:8.3f}  "
              f"{row['ms']['torch']['median']:8.3f}  {ratio['median']:8.3f}  {control['median']:6.3f}  "
              f"{row['mean_ms']['old']['median']:8.3f}  {row['mean_ms']['new']['median']:8.3f}  "
              f"{row['mean_ms']['torch']['median']:10.3f}")

    widths = deeplab_layers()
    paper = on_paper(widths)
    print(f"\non paper: DeepLabV3+ / ResNet-101, {len(widths)} synchronized layers, {sum(widths):,} channels; "
          "MB received per process and step by the forward exchange")
    print(f"{'W':>5}  {'old':>10}  {'new':>8}  {'new ring':>9}  {'torch':>10}")
    for row in paper:
        print(f"{row['world']:>5}  {row['old_received'] / 1e6:10.1f}  {row['new_received'] / 1e6:8.3f}  "
              f"{row['new_wire'] / 1e6:9.3f}  {row['torch_received'] / 1e6:10.1f}")

    received = [results[w]["bytes"]["new"]["received"] for w in worlds]
    flat = {"median": max(received) / min(received)}
    targets = [judge("syncbn scale new bytes flat", flat, target=1.01, control=None)]
    if 2 in results and len(worlds) > 1:
        largest = max(worlds)
        a, b = results[largest]["times"]["new"], results[2]["times"]["old"]
        figure = {"median": statistics.median(a) / statistics.median(b), "q1": min(a) / max(b),
                  "q3": max(a) / min(b), "min": min(a) / max(b), "max": max(a) / min(b), "pairs": 0}
        controls = [row["control"] for row in rows if row["world"] in (2, largest)]
        worse = max(controls, key=lambda c: abs(c["median"] - 1))
        targets.append(judge(f"syncbn scale new time W={largest} / old W=2", figure, target=1.0, control=worse))
    print_targets(targets)
    write_record("bench_syncbn_scale", args.output, {
        "environment": env, "worlds": rows, "on_paper": paper, "deeplab_layers": len(widths),
        "deeplab_channels": sum(widths), "targets": targets})


if __name__ == "__main__":
    stable_allocator("benchmarks.bench_syncbn_scale", sys.argv[1:])
    main()
