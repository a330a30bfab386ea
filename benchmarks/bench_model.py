"""Training-step time of our DeepLabV3 against torchvision's, same run, paired ratios.

    python -m benchmarks.bench_model [--repeats 32] [--batch 2] [--size 129] [--threads 1] [--output results.json]

Defaults: one thread and 129 px. With two threads on this 2-core machine a step varies ~8% from one
repetition to the next (8 pairs gave an A/A control of 1.020); with one thread it varies ~3%, and a
smaller input buys more repetitions in the same time. The ratio compares two identical networks, so it
does not depend on the input size.

Variants (identical weights, training mode, cross-entropy on random labels for `out` + 0.4 `aux`,
forward + backward, gradients cleared each step):
- ours: build_model(deeplabv3, resnet50, output stride 8, aux_loss, norm=syncbn), the network we train;
- ours_bn: the same with norm=bn (isolates the SynchronizedBatchNorm2d overhead on one device);
- torchvision: torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None,
  num_classes=21, aux_loss=True);
- torchvision copy: a second instance of it with the same weights, the A/A control (benchmarks/common.py):
  the verdict needs torchvision copy / torchvision within 1.02.
Each repetition runs every variant once, in a balanced order (benchmarks.common.balanced_orders: each
variant follows each other one equally often), so machine noise hits all alike; reported are the median
step times and the medians of the per-repetition ratios to torchvision, for wall-clock time and for the
process's CPU time (time.process_time: on a shared machine it does not count the time the process waits for a core, which dominates wall-clock noise; with
--threads 1 it is the cost of the step). Target: ours / torchvision <= 1.03 (the same network must cost
the same).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torchvision.models.segmentation import deeplabv3_resnet50

from benchmarks.common import balanced_orders, environment, judge, paired, print_targets, quiet_gc, stable_allocator
from benchmarks.common import write_record
from syncseg.engine.config import ModelConfig
from syncseg.model.builder import build_model
from syncseg.model.weights import load_segmentation_weights

NUM_CLASSES = 21
TARGET = 1.03


def make_models(device: torch.device) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    reference = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=NUM_CLASSES, aux_loss=True)
    twin = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=NUM_CLASSES, aux_loss=True)
    twin.load_state_dict(reference.state_dict())
    models = {"torchvision": reference, "torchvision copy": twin}
    for name, norm in (("ours", "syncbn"), ("ours_bn", "bn")):
        model = build_model(ModelConfig(arch="deeplabv3", backbone="resnet50", output_stride=8, aux_loss=True,
                                        norm=norm), NUM_CLASSES)
        load_segmentation_weights(model, reference.state_dict())
        models[name] = model
    return {name: model.to(device).train() for name, model in models.items()}


def training_step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds of one forward + backward (gradients cleared first, device synced)."""
    model.zero_grad(set_to_none=True)
    if images.device.type == "cuda":
        torch.cuda.synchronize(images.device)
    start, start_cpu = time.perf_counter(), time.process_time()
    result = model(images)
    loss = F.cross_entropy(result["out"], labels) + 0.4 * F.cross_entropy(result["aux"], labels)
    loss.backward()
    if images.device.type == "cuda":
        torch.cuda.synchronize(images.device)
    return time.perf_counter() - start, time.process_time() - start_cpu


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=32,
                        help="timed repetitions (each runs every variant once; 4 make one balanced cycle)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each variant first")
    parser.add_argument("--batch", type=int, default=2, help="images per training step")
    parser.add_argument("--size", type=int, default=129, help="square input size, pixels")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/bench_model.json)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    models = make_models(device)
    names = list(models)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.size, args.size, generator=generator).to(device)
    labels = torch.randint(0, NUM_CLASSES, (args.batch, args.size, args.size), generator=generator).to(device)

    for _ in range(args.warmup):
        for name in names:
            training_step(models[name], images, labels)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    orders = balanced_orders(names)
    for repeat in range(args.repeats):
        order = orders[repeat % len(orders)]
        for name in order:
            with quiet_gc():
                wall, cpu = training_step(models[name], images, labels)
            times[name].append(wall)
            cpu_times[name].append(cpu)
        print(f"  repetition {repeat + 1}/{args.repeats} (wall / cpu s): "
              + ", ".join(f"{name} {times[name][-1]:.3f} / {cpu_times[name][-1]:.3f}" for name in names), flush=True)

    rows = []
    for name in names:
        ratios = [t / r for t, r in zip(times[name], times["torchvision"])]
        cpu_ratios = [t / r for t, r in zip(cpu_times[name], cpu_times["torchvision"])]
        rows.append({
            "variant": name,
            "wall_median_s": statistics.median(times[name]),
            "wall_min_s": min(times[name]),
            "wall_ratio_median": statistics.median(ratios),
            "cpu_median_s": statistics.median(cpu_times[name]),
            "cpu_ratio_median": statistics.median(cpu_ratios),
            "wall_ratios": ratios,
            "cpu_ratios": cpu_ratios,
            "wall_s": times[name],
            "cpu_s": cpu_times[name],
        })
    print(f"\nDeepLabV3-ResNet50 OS8 + aux, training step (forward + backward), batch {args.batch}, "
          f"{args.size}x{args.size}, {device}, {torch.get_num_threads()} threads, {args.repeats} repetitions")
    print(f"{'variant':<16} {'wall med s':>10} {'wall min s':>10} {'wall ratio':>10} {'cpu med s':>10} {'cpu ratio':>10}")
    for row in rows:
        print(f"{row['variant']:<16} {row['wall_median_s']:>10.3f} {row['wall_min_s']:>10.3f} "
              f"{row['wall_ratio_median']:>10.3f} {row['cpu_median_s']:>10.3f} {row['cpu_ratio_median']:>10.3f}")
    clock = cpu_times if device.type == "cpu" else times  # CPU time on a shared CPU, wall time on a GPU
    figure = paired(clock["ours"], clock["torchvision"])
    control = paired(clock["torchvision copy"], clock["torchvision"])
    targets = [judge("model ours/torchvision step", figure, target=TARGET, control=control)]
    print_targets(targets)
    result = {
        "benchmark": "bench_model",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": vars(args) | {"num_threads": torch.get_num_threads()},
        "environment": environment(device=str(device), clock="process CPU time" if device.type == "cpu" else "wall"),
        "rows": rows,
        "targets": targets,
    }
    write_record("bench_model", args.output, result)
    return result


if __name__ == "__main__":
    stable_allocator("benchmarks.bench_model", sys.argv[1:])  # re-executes once, when run as a program
    main()
