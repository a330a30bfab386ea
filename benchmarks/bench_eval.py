"""Evaluation speed: confusion-matrix updates and whole vs sliding-window inference, same process.

Confusion matrix (a batch of 8 x 513 x 513 with 21 classes, ~10% ignore pixels), variants timed
interleaved over several rounds:
  ours_int64      engine.metrics.ConfusionMatrix.update on int64 prediction and target (as from argmax / masks)
  ours_uint8      the same with a uint8 target
  numpy_bincount  the classic numpy implementation: mask = (t >= 0) & (t < C); bincount(C * t[mask] + p[mask])
  torch_masked    the same in torch with boolean masking (what a first torch port usually looks like)
All variants must produce the same matrix (checked). Target (issue 4): ours_int64 >= 3x numpy_bincount.

Inference: engine.inference.predict with a small DeepLabV3+ / ResNet-18, mode whole vs slide (and
slide + flip), images/s.

    python -m benchmarks.bench_eval [--rounds 7] [--threads 1] [--device cpu|cuda] [--output PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.inference import predict
from engine.metrics import ConfusionMatrix
from model.builder import build_model


def numpy_bincount(pred: np.ndarray, target: np.ndarray, num_classes: int) -> np.ndarray:
    mask = (target >= 0) & (target < num_classes)
    return np.bincount(num_classes * target[mask].astype(np.int64) + pred[mask],
                       minlength=num_classes ** 2).reshape(num_classes, num_classes)


def torch_masked(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    mask = (target >= 0) & (target < num_classes)
    return torch.bincount(num_classes * target[mask] + pred[mask], minlength=num_classes ** 2).view(
        num_classes, num_classes)


def _time(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_confusion(rounds: int, device: torch.device) -> dict:
    num_classes, shape = 21, (8, 513, 513)
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, num_classes, shape, generator=generator)
    target[torch.rand(shape, generator=generator) < 0.1] = 255
    pred = torch.randint(0, num_classes, shape, generator=generator)
    pred_np, target_np = pred.numpy(), target.numpy()
    pred_d, target_d = pred.to(device), target.to(device)
    target_u8 = target_d.to(torch.uint8)
    reference = numpy_bincount(pred_np, target_np, num_classes)
    matrix = ConfusionMatrix(num_classes, device=device)

    def ours(t):
        def run():
            matrix.reset()
            matrix.update(pred_d, t)
        return run

    variants = {
        "ours_int64": ours(target_d),
        "ours_uint8": ours(target_u8),
        "numpy_bincount": lambda: numpy_bincount(pred_np, target_np, num_classes),
        "torch_masked": lambda: torch_masked(pred_d, target_d, num_classes),
    }
    for name, fn in variants.items():  # warm-up + correctness
        fn()
        got = matrix.matrix.cpu().numpy() if name.startswith("ours") else None
        if got is not None and not np.array_equal(got, reference):
            raise AssertionError(f"{name} disagrees with numpy_bincount")
    if not np.array_equal(torch_masked(pred_d, target_d, num_classes).cpu().numpy(), reference):
        raise AssertionError("torch_masked disagrees with numpy_bincount")
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(_time(fn, device))
    base = times["numpy_bincount"]
    rows = {}
    for name, values in times.items():
        rows[name] = {
            "median_ms": 1000 * statistics.median(values),
            "speedup_vs_numpy": statistics.median(b / v for b, v in zip(base, values)),
        }
    return {"batch": list(shape), "num_classes": num_classes, "rounds": rounds, "variants": rows}


def bench_inference(rounds: int, device: torch.device, *, height: int, width: int, crop: int, stride: int) -> dict:
    torch.manual_seed(0)
    model_cfg = ModelConfig(backbone="resnet18", head_channels=64, norm="bn", output_stride=16)
    model = build_model(model_cfg, 19).to(device).eval()
    images = torch.randn(1, 3, height, width, device=device)
    variants = {
        "whole": dict(mode="whole"),
        "slide": dict(mode="slide", window_size=crop, stride=stride),
        "slide_flip": dict(mode="slide", window_size=crop, stride=stride, flip=True),
    }
    with torch.inference_mode():
        for options in variants.values():
            predict(model, images, num_classes=19, **options)
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, options in variants.items():
                times[name].append(_time(lambda: predict(model, images, num_classes=19, **options), device))
    base = times["whole"]
    rows = {}
    for name, values in times.items():
        rows[name] = {
            "median_ms": 1000 * statistics.median(values),
            "images_per_s": 1 / statistics.median(values),
            "time_vs_whole": statistics.median(v / b for b, v in zip(base, values)),
        }
    return {"image": [height, width], "crop_size": crop, "stride": stride, "model": "deeplabv3plus/resnet18 OS16 "
            "head 64", "rounds": rounds, "variants": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the confusion-matrix variants")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1, like numpy's single-threaded bincount; 0 = torch's "
                             "default). On a loaded machine more threads than free cores make every parallel op "
                             "wait for a descheduled thread, which swamps these millisecond-scale kernels")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--height", type=int, default=256, help="inference image height, pixels")
    parser.add_argument("--width", type=int, default=512, help="inference image width, pixels")
    parser.add_argument("--crop", type=int, default=256, help="sliding window size, pixels")
    parser.add_argument("--stride", type=int, default=171, help="sliding window step, pixels")
    parser.add_argument("--output", default=str(Path(__file__).resolve().parent / "results" / "bench_eval.json"),
                        help="JSON results file")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    confusion = bench_confusion(args.rounds, device)
    inference = bench_inference(max(3, args.rounds // 2), device, height=args.height, width=args.width,
                                crop=args.crop, stride=args.stride)

    print(f"confusion matrix update, batch {confusion['batch']}, {confusion['num_classes']} classes, "
          f"{args.rounds} interleaved rounds, {torch.get_num_threads()} thread(s), {device}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'variant':<16} {'median ms':>10} {'x numpy':>9}")
    for name, row in confusion["variants"].items():
        print(f"{name:<16} {row['median_ms']:10.2f} {row['speedup_vs_numpy']:9.2f}")
    print()
    print(f"inference {inference['model']}, image {inference['image'][0]}x{inference['image'][1]}, "
          f"crop {inference['crop_size']} stride {inference['stride']}")
    print(f"{'mode':<16} {'median ms':>10} {'images/s':>9} {'x whole':>9}")
    for name, row in inference["variants"].items():
        print(f"{name:<16} {row['median_ms']:10.1f} {row['images_per_s']:9.2f} {row['time_vs_whole']:9.2f}")

    record = {
        "benchmark": "bench_eval",
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
        "confusion_matrix": confusion,
        "inference": inference,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
