"""Training-step time of our DeepLabV3 against torchvision's, same run, paired ratios.

    python benchmarks/bench_model.py [--repeats 9] [--batch 2] [--size 257] [--threads N] [--output results.json]

Variants (identical weights, training mode, cross-entropy on random labels for `out` + 0.4 `aux`,
forward + backward, gradients cleared each step):
- ours: build_model(deeplabv3, resnet50, output stride 8, aux_loss, norm=syncbn), the network we train;
- ours_bn: the same with norm=bn (isolates the SynchronizedBatchNorm2d overhead on one device);
- torchvision: torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None,
  num_classes=21, aux_loss=True).
Each repetition runs every variant once, in an order that rotates between repetitions, so machine noise
hits all alike; reported are the median step times and the medians of the per-repetition ratios to
torchvision. Target: ours / torchvision <= 1.03 (the same network must cost the same).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision.models.segmentation import deeplabv3_resnet50

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import ModelConfig  # noqa: E402
from model.builder import build_model, load_segmentation_weights  # noqa: E402

NUM_CLASSES = 21
TARGET = 1.03


def make_models(device: torch.device) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    reference = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=NUM_CLASSES, aux_loss=True)
    models = {"torchvision": reference}
    for name, norm in (("ours", "syncbn"), ("ours_bn", "bn")):
        model = build_model(ModelConfig(arch="deeplabv3", backbone="resnet50", output_stride=8, aux_loss=True,
                                        norm=norm), NUM_CLASSES)
        load_segmentation_weights(model, reference.state_dict())
        models[name] = model
    return {name: model.to(device).train() for name, model in models.items()}


def training_step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Seconds for one forward + backward (gradients cleared first, device synchronized)."""
    model.zero_grad(set_to_none=True)
    if images.device.type == "cuda":
        torch.cuda.synchronize(images.device)
    start = time.perf_counter()
    result = model(images)
    loss = F.cross_entropy(result["out"], labels) + 0.4 * F.cross_entropy(result["aux"], labels)
    loss.backward()
    if images.device.type == "cuda":
        torch.cuda.synchronize(images.device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=257)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default=str(Path(__file__).resolve().parent / "results" / "bench_model.json"))
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
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in order:
            times[name].append(training_step(models[name], images, labels))
        print(f"  repetition {repeat + 1}/{args.repeats}: "
              + ", ".join(f"{name} {times[name][-1]:.3f}s" for name in names), flush=True)

    reference = times["torchvision"]
    rows = []
    for name in names:
        ratios = [t / r for t, r in zip(times[name], reference)]
        rows.append({
            "variant": name,
            "median_s": statistics.median(times[name]),
            "min_s": min(times[name]),
            "median_ratio_to_torchvision": statistics.median(ratios),
            "ratios": ratios,
            "times_s": times[name],
        })
    print(f"\nDeepLabV3-ResNet50 OS8 + aux, training step (forward + backward), batch {args.batch}, "
          f"{args.size}x{args.size}, {device}, {torch.get_num_threads()} threads, {args.repeats} repetitions")
    print(f"{'variant':<12} {'median s':>9} {'min s':>8} {'ratio (median of paired)':>26}")
    for row in rows:
        print(f"{row['variant']:<12} {row['median_s']:>9.3f} {row['min_s']:>8.3f} "
              f"{row['median_ratio_to_torchvision']:>26.3f}")
    ours_ratio = rows[names.index("ours")]["median_ratio_to_torchvision"]
    verdict = "meets" if ours_ratio <= TARGET else "misses"
    print(f"ours / torchvision = {ours_ratio:.3f} ({verdict} the target <= {TARGET})")

    result = {
        "benchmark": "bench_model",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": vars(args) | {"num_threads": torch.get_num_threads()},
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "target_ratio": TARGET,
        "ours_ratio": ours_ratio,
        "meets_target": ours_ratio <= TARGET,
        "rows": rows,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    main()
