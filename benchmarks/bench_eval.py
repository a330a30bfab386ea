"""Evaluation speed: confusion-matrix updates and whole vs sliding-window inference, same process.

Confusion matrix (a batch of 8 x 513 x 513 with 21 classes, ~10% ignore pixels), variants timed
interleaved over several rounds:
  ours_int64      syncseg.engine.confusion.ConfusionMatrix.update on int64 prediction and target (as from argmax /
                  masks), with torch's default thread count: what eval.py and validation run
  ours_int64_1t   the same on one thread
  ours_uint8      the same as ours_int64 with a uint8 target
  numpy_bincount  the classic numpy implementation: mask = (t >= 0) & (t < C); bincount(C * t[mask] + p[mask])
  torch_masked    the same in torch with boolean masking (what a first torch port usually looks like)
All variants must produce the same matrix (checked). Target (issue 4): ours_int64 >= 3x numpy_bincount.
Why the target is judged at torch's default thread count (issue 31): that is what a user's evaluation runs,
and numpy's bincount path has no threads to use. The update is bound by memory passes over the two int64
tensors (16 MB each at VOC's batch: 0.5-0.8 ms a pass on 2 threads of a 2-core AMD EPYC VM, whatever the
operation): it reads each twice (a range check, then one add that reads both tensors' low words into an
int32 index) and then runs torch's bincount (one thread, ~1.3 ms); torch has no single kernel that checks
ranges, narrows and adds in one pass. The one-thread figure (2.3-2.9x) is printed beside it.

Inference: syncseg.engine.inference.predict with a small DeepLabV3+ / ResNet-18, mode whole vs slide (and
slide + flip), images/s. Target (issue 13): slide / whole <= 1.15 at equal pixels, i.e. the time per
window pixel of sliding-window inference against the time per pixel of whole-image inference (the
windows overlap, so they cover more pixels than the image).

Each comparison runs beside an A/A control (numpy_bincount_copy, whole_copy); a verdict needs it within
1.02 (benchmarks/common.py).

    python -m benchmarks.bench_eval [--rounds 150] [--inference-rounds 24] [--threads 1] [--device cpu|cuda] [--output PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
import torch

from benchmarks.common import environment, judge, paired, print_targets, stable_allocator, time_interleaved
from benchmarks.common import write_record
from syncseg.data.transforms import IGNORE_INDEX
from syncseg.engine.config import EvalConfig, ModelConfig
from syncseg.engine.inference import eval_settings, predict, window_starts
from syncseg.engine.confusion import ConfusionMatrix
from syncseg.model.builder import build_model


def numpy_bincount(pred: np.ndarray, target: np.ndarray, num_classes: int) -> np.ndarray:
    mask = (target >= 0) & (target < num_classes)
    return np.bincount(num_classes * target[mask].astype(np.int64) + pred[mask],
                       minlength=num_classes ** 2).reshape(num_classes, num_classes)


def torch_masked(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    mask = (target >= 0) & (target < num_classes)
    return torch.bincount(num_classes * target[mask] + pred[mask], minlength=num_classes ** 2).view(
        num_classes, num_classes)


def _synchronizer(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def bench_confusion(rounds: int, device: torch.device, threads: int) -> dict:
    num_classes, shape = 21, (8, 513, 513)
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, num_classes, shape, generator=generator)
    target[torch.rand(shape, generator=generator) < 0.1] = 255
    pred = torch.randint(0, num_classes, shape, generator=generator)
    pred_np, target_np = pred.numpy(), target.numpy()
    pred_d, target_d = pred.to(device), target.to(device)
    target_u8 = target_d.to(torch.uint8)
    reference = numpy_bincount(pred_np, target_np, num_classes)
    matrix = ConfusionMatrix(num_classes, ignore_index=IGNORE_INDEX, device=device)

    def ours(t, run_threads=threads):
        def run():
            torch.set_num_threads(run_threads)
            try:
                matrix.reset()
                matrix.update(pred_d, t)
            finally:
                torch.set_num_threads(threads)
        return run

    variants = {
        "ours_int64": ours(target_d),
        "ours_int64_1t": ours(target_d, 1),
        "ours_uint8": ours(target_u8),
        "numpy_bincount": lambda: numpy_bincount(pred_np, target_np, num_classes),
        "numpy_bincount_copy": lambda: numpy_bincount(pred_np, target_np, num_classes),
        "torch_masked": lambda: torch_masked(pred_d, target_d, num_classes),
    }
    for name, fn in variants.items():  # warm-up + correctness
        fn()
        got = matrix.matrix.cpu().numpy() if name.startswith("ours") else None
        if got is not None and not np.array_equal(got, reference):
            raise AssertionError(f"{name} disagrees with numpy_bincount")
    if not np.array_equal(torch_masked(pred_d, target_d, num_classes).cpu().numpy(), reference):
        raise AssertionError("torch_masked disagrees with numpy_bincount")
    times = time_interleaved(variants, rounds, inner=2, before=_synchronizer(device), after=_synchronizer(device),
                             warmup=0)
    base = times["numpy_bincount"]
    rows = {}
    for name, values in times.items():
        rows[name] = {
            "median_ms": 1000 * statistics.median(values),
            "speedup_vs_numpy": statistics.median(b / v for b, v in zip(base, values)),
        }
    target = judge("eval confusion ours speedup vs numpy", paired(base, times["ours_int64"]), target=3.0,
                   control=paired(times["numpy_bincount_copy"], base), higher_is_better=True)
    return {"batch": list(shape), "num_classes": num_classes, "rounds": rounds, "threads": threads, "variants": rows,
            "target": target}


def bench_inference(rounds: int, device: torch.device, *, height: int, width: int, crop: int, stride: int) -> dict:
    torch.manual_seed(0)
    model_cfg = ModelConfig(backbone="resnet18", head_channels=64, norm="bn", output_stride=16)
    model = build_model(model_cfg, 19).to(device).eval()
    images = torch.randn(1, 3, height, width, device=device)
    options = {
        "whole": dict(mode="whole"),
        "whole_copy": dict(mode="whole"),
        "slide": dict(mode="slide", window_size=crop, stride=stride),
        "slide_flip": dict(mode="slide", window_size=crop, stride=stride, flip=True),
    }
    variants = {name: (lambda o=o: predict(model, images, num_classes=19, **eval_settings(EvalConfig(**o)))) for name, o in options.items()}
    with torch.inference_mode():
        times = time_interleaved(variants, rounds, before=_synchronizer(device), after=_synchronizer(device))
    windows = len(window_starts(height, crop, stride)) * len(window_starts(width, crop, stride))
    pixel_factor = windows * min(crop, height) * min(crop, width) / (height * width)  # window pixels / image pixels
    base = times["whole"]
    rows = {}
    for name, values in times.items():
        rows[name] = {
            "median_ms": 1000 * statistics.median(values),
            "images_per_s": 1 / statistics.median(values),
            "time_vs_whole": statistics.median(v / b for b, v in zip(base, values)),
        }
    per_pixel = paired([t / pixel_factor for t in times["slide"]], base)
    target = judge("eval slide/whole at equal pixels", per_pixel, target=1.15, control=paired(times["whole_copy"], base))
    return {"image": [height, width], "crop_size": crop, "stride": stride, "windows": windows,
            "window_pixels_per_image_pixel": pixel_factor, "model": "deeplabv3plus/resnet18 OS16 head 64",
            "rounds": rounds, "variants": rows, "target": target}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=150,
                        help="interleaved rounds of the confusion-matrix variants (10 make one balanced cycle)")
    parser.add_argument("--inference-rounds", type=int, default=24,
                        help="interleaved rounds of the inference modes (4 make one balanced cycle)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for the inference part (default 1; 0 = torch's default). On a "
                             "loaded machine more threads than free cores make every parallel op wait for a "
                             "descheduled thread, which swamps these millisecond-scale kernels")
    parser.add_argument("--confusion-threads", type=int, default=0,
                        help="torch CPU threads for ours_int64 / ours_uint8 (default 0: torch's default, what "
                             "eval.py runs; ours_int64_1t always runs on one)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--height", type=int, default=256, help="inference image height, pixels")
    parser.add_argument("--width", type=int, default=512, help="inference image width, pixels")
    parser.add_argument("--crop", type=int, default=256, help="sliding window size, pixels")
    parser.add_argument("--stride", type=int, default=171, help="sliding window step, pixels")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/bench_eval.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    confusion = bench_confusion(args.rounds, device, args.confusion_threads or torch.get_num_threads())
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    inference = bench_inference(args.inference_rounds, device, height=args.height, width=args.width,
                                crop=args.crop, stride=args.stride)

    print(f"confusion matrix update, batch {confusion['batch']}, {confusion['num_classes']} classes, "
          f"{args.rounds} interleaved rounds, {confusion['threads']} thread(s), {device} "
          f"({torch.backends.cpu.get_cpu_capability()} kernels), "
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
    print(f"({inference['windows']} windows cover {inference['window_pixels_per_image_pixel']:.2f}x the image's pixels)")
    targets = [confusion["target"], inference["target"]]
    print_targets(targets)
    write_record("bench_eval", args.output, {
        "benchmark": "bench_eval", "numpy": np.__version__, "device": str(device),
        "environment": environment(device=str(device)), "confusion_matrix": confusion, "inference": inference,
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    stable_allocator("benchmarks.bench_eval", sys.argv[1:])  # re-executes once, when run as a program
    sys.exit(main())
