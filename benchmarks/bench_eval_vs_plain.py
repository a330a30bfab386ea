"""eval.py against a plain evaluation loop, each as a user runs it: whole images of varying size.

Every variant is its own process started with this process's environment (the user's shell: glibc's
allocator defaults unless the user set MALLOC_* or LD_PRELOAD; this benchmark does not re-execute itself
with raised thresholds), on the same weights and images:
  syncseg_fp32   python eval.py --checkpoint <generated> --amp off (the product; it keeps freed memory for
                 reuse by itself, syncseg/engine/allocator.py; model.channels_last=auto takes channels-last for
                 a ResNet-50 in fp32 on a CPU: syncseg/engine/devices.py)
  syncseg_fp32_nchw  the same in the usual layout (model.channels_last=off), for the table only
  syncseg_auto   python eval.py --checkpoint <generated>: the product's defaults (eval.amp=auto,
                 channels_last=auto: bf16 in channels-last on CPUs with native bf16, fp32 elsewhere)
  plain          benchmarks/plain_eval.py: torchvision's deeplabv3_resnet50 given the same weights, the
                 reference trainer's evaluate() and confusion matrix, float32
  plain_copy     the same again: the A/A control
  plain_kept     the plain loop with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised (what the product
                 does by itself), for the table only
Data: a VOC2012 tree written here (JPEG photos of the synthetic shapes, palette PNG masks with a void
border), `--images` whole images in VOC's common sizes (500 x 375, 375 x 500, 500 x 333, ...), so nearly
every image's activations differ in size from the last one's: the case where a fresh allocation per image
meets glibc returning freed blocks to the OS. Model: DeepLabV3 / ResNet-50, output stride 8, the aux head
in the checkpoint (as training leaves it); both loops compute only the main output. The weights are one
random torchvision initialization, given to both, so both must report the same mIoU (checked).
A sample is one process's wall time from start to exit, start-up and model loading included: what the
user waits for. Rounds run the variants in balanced orders (benchmarks/common.py); ratios (images/s,
higher is better) are paired within a round.
Target (issue 31): syncseg_fp32 / plain >= 1.10 and syncseg_auto / plain >= 1.10.

    python -m benchmarks.bench_eval_vs_plain [--rounds 3] [--images 12] [--output PATH]

Takes about 3 minutes a round on a 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ALLOCATOR_VARIABLES, STABLE_ALLOCATOR, balanced_orders, environment, print_targets
from benchmarks.common import versus_plain, write_record

ROOT = Path(__file__).resolve().parent.parent
SIZES = [(375, 500), (500, 375), (333, 500), (500, 333), (366, 500), (500, 400), (281, 500), (500, 442)]

CONFIG = """\
name: eval_vs_plain
data:
  dataset: voc
  root: {root}
  val_split: val
  num_workers: 1
model:
  arch: deeplabv3
  backbone: resnet50
  output_stride: 8
  pretrained_backbone: none
  norm: syncbn
  aux_loss: true
"""


def write_voc(root: Path, count: int) -> None:
    """A VOC2012 tree of `count` val images in VOC's sizes: JPEG photos, palette PNGs with a void frame."""
    import cv2
    import numpy as np

    from syncseg.data.base import palette_image
    from syncseg.data.synthetic import MAX_CLASSES, render_shapes
    from syncseg.data.voc import VOC_PALETTE

    rng = np.random.default_rng(0)
    names = [f"2007_{index:06d}" for index in range(count)]
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(names):
        height, width = SIZES[index % len(SIZES)]
        image, mask = render_shapes(rng, max(height, width), num_classes=MAX_CLASSES)
        image, mask = image[:height, :width], mask[:height, :width].copy()
        mask[:4], mask[-4:], mask[:, :4], mask[:, -4:] = 255, 255, 255, 255
        assert cv2.imwrite(str(root / "JPEGImages" / f"{name}.jpg"), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        palette_image(mask, VOC_PALETTE).save(root / "SegmentationClass" / f"{name}.png")
    (root / "ImageSets" / "Segmentation" / "val.txt").write_text("".join(f"{name}\n" for name in names))


def write_weights(config_path: Path, checkpoint: Path, plain_weights: Path) -> None:
    """One random torchvision DeepLabV3 / ResNet-50 (BatchNorm running statistics moved off their initial
    values, so that they matter), saved as a syncseg checkpoint (through the product's own loading of
    torchvision weights) and as torchvision's state dict without the aux head (for the plain loop)."""
    import torch
    from torchvision.models.segmentation import deeplabv3_resnet50

    from syncseg.data.label_tables import VOC_CLASSES
    from syncseg.engine.checkpoint_file import FORMAT_VERSION, save_checkpoint
    from syncseg.engine.config import load_config, to_dict
    from syncseg.model.builder import build_model
    from syncseg.model.weights import load_segmentation_weights

    torch.manual_seed(0)
    reference = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=21, aux_loss=True)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 2.0)
    state = reference.state_dict()
    config = load_config(str(config_path), [])
    ours = build_model(config.model, len(VOC_CLASSES))
    report = load_segmentation_weights(ours, state)
    assert not report.skipped and not report.missing, report
    save_checkpoint(checkpoint, {"format_version": FORMAT_VERSION, "model": ours.state_dict(),
                                 "config": to_dict(config), "classes": list(VOC_CLASSES), "iteration": 0})
    torch.save({key: value for key, value in state.items() if not key.startswith("aux_classifier.")}, plain_weights)


def timed(command: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, done


def run_product(checkpoint: Path, report: Path, env: dict[str, str], flags: list[str]) -> dict:
    command = [sys.executable, str(ROOT / "eval.py"), "--checkpoint", str(checkpoint), "--device", "cpu",
               "--no-progress", "--output", str(report), *flags]
    seconds, done = timed(command, env)
    record = json.loads(report.read_text())
    allocator = next((line for line in done.stderr.splitlines() if "freed memory" in line or "allocator" in line), "")
    return {"seconds": seconds, "images": record["num_images"], "miou": record["miou"], "log": allocator.strip(),
            "amp": record["protocol"]["amp"]}


def run_plain(config: Path, weights: Path, out: Path, env: dict[str, str]) -> dict:
    command = [sys.executable, "-m", "benchmarks.plain_eval", "--config", str(config), "--split", "val",
               "--weights", str(weights), "--output", str(out)]
    seconds, _ = timed(command, env)
    record = json.loads(out.read_text())
    return {"seconds": seconds, "images": record["images"], "miou": record["miou"],
            "loop_seconds": record["loop_seconds"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every variant once")
    parser.add_argument("--images", type=int, default=12, help="whole images evaluated by every run")
    parser.add_argument("--output", default=None,
                        help="JSON path (default benchmarks/results/bench_eval_vs_plain.json)")
    args = parser.parse_args(argv)

    user_env = dict(os.environ)
    user_env.setdefault("PYTHONPATH", str(ROOT))
    kept_env = {**user_env, **STABLE_ALLOCATOR}
    rows: list[dict[str, float]] = []
    logs: dict[str, str] = {}
    mious: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        write_voc(tmp_path / "VOC2012", args.images)
        config = tmp_path / "eval_vs_plain.yaml"
        config.write_text(CONFIG.format(root=tmp_path / "VOC2012"))
        checkpoint, weights = tmp_path / "best.pt", tmp_path / "torchvision_state.pt"
        write_weights(config, checkpoint, weights)
        variants = {
            "syncseg_fp32": lambda out: run_product(checkpoint, out, user_env, ["--amp", "off"]),
            "syncseg_fp32_nchw": lambda out: run_product(checkpoint, out, user_env, ["--amp", "off",
                                                                                     "model.channels_last=off"]),
            "syncseg_auto": lambda out: run_product(checkpoint, out, user_env, []),
            "plain": lambda out: run_plain(config, weights, out, user_env),
            "plain_copy": lambda out: run_plain(config, weights, out, user_env),
            "plain_kept": lambda out: run_plain(config, weights, out, kept_env),
        }
        orders = balanced_orders(list(variants))
        for round_index in range(args.rounds):
            row: dict[str, float] = {}
            for name in orders[round_index % len(orders)]:
                result = variants[name](tmp_path / f"{name}_{round_index}.json")
                if result["images"] != args.images:
                    raise RuntimeError(f"{name} evaluated {result['images']} images, expected {args.images}")
                row[name] = result["images"] / result["seconds"]
                mious[name] = result["miou"]
                if result.get("log"):
                    logs[name] = result["log"]
                extra = f", loop alone {result['loop_seconds']:.1f} s" if "loop_seconds" in result else ""
                extra += f", amp {result['amp']}" if "amp" in result else ""
                print(f"round {round_index} {name:<13} {row[name]:.3f} img/s  ({result['seconds']:.1f} s for "
                      f"{result['images']} images{extra}; mIoU {result['miou']:.6f})", flush=True)
            rows.append(row)

    # the same weights and images: the fp32 runs must agree but for pixels whose top two logits are within
    # float rounding (bf16 may move more)
    if abs(mious["syncseg_fp32"] - mious["plain"]) > 0.01 * mious["plain"] + 1e-6:
        raise RuntimeError(f"eval.py (fp32) and the plain loop disagree: mIoU {mious['syncseg_fp32']} vs "
                           f"{mious['plain']}: they do not evaluate the same thing")
    env = environment()
    print(f"\nDeepLabV3 / ResNet-50 OS8, {args.images} whole VOC-sized images (batch 1, 1 loader worker), "
          f"{args.rounds} rounds, process wall time; environment as started ({env['allocator']}; torch kernels "
          f"{env['cpu_capability']}, bf16 flags {env['cpu_bf16'] or 'none'})")
    medians, targets = versus_plain(rows, list(variants), "eval vs plain", extra={"mIoU": mious})
    for name, line in logs.items():
        print(f"{name}: {line}")
    print_targets(targets)
    write_record("bench_eval_vs_plain", args.output, {
        "benchmark": "bench_eval_vs_plain", "rounds": rows, "medians_images_per_s": medians, "images": args.images,
        "miou": mious, "logs": logs,
        "environment": environment(user_allocator_env={name: os.environ.get(name) for name in ALLOCATOR_VARIABLES}),
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
