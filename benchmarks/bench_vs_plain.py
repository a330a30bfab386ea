"""The product against a plain PyTorch loop, each as a user runs it: `train.py` vs benchmarks/plain_loop.py.

Every variant is its own process started with this process's environment (the user's shell: glibc's
allocator defaults unless the user set MALLOC_* or LD_PRELOAD; this benchmark does not re-execute itself
with raised thresholds as the others do), on the same model and data:
  syncseg_fp32   python train.py --config <generated> train.amp=off (the product; it keeps freed memory
                 for reuse by itself, syncseg/engine/allocator.py; model.channels_last=auto takes channels-last
                 for a ResNet-50 in fp32 on a CPU: syncseg/engine/devices.py)
  syncseg_fp32_nchw  the same in the usual layout (model.channels_last=off), for the table only
  syncseg_auto   the same with train.amp=auto and model.channels_last=auto (the product's defaults: bf16 in
                 channels-last on CPUs with native bf16, fp32 elsewhere)
  plain          benchmarks/plain_loop.py: torchvision's deeplabv3_resnet50, CE + 0.5 aux CE, SGD, DataLoader,
                 float32 (torchvision's reference trainer has no CPU autocast)
  plain_copy     the same again: the A/A control
  plain_kept     the plain loop with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised (what the product
                 does by itself), for the table only
Model: DeepLabV3 / ResNet-50, output stride 8, aux head (torchvision's architecture; the product builds the
same 42M parameters with its own code), batch 4, 256 px crops of the synthetic set, one loader worker, SGD.
Each run trains `--windows` + 1 windows of `--window` iterations; the first window (start-up, first steps)
is dropped, images/s is the mean over the rest (data waits included, validation and checkpoints outside).
Rounds run the variants in balanced orders (benchmarks/common.py); ratios are paired within a round.
Targets (issue 31): syncseg_fp32 / plain >= 1.10 and syncseg_auto / plain >= 1.10.

    python -m benchmarks.bench_vs_plain [--rounds 3] [--window 3] [--windows 2] [--crop 256] [--output PATH]

Takes about 7 minutes a round (20 in all) on a 2-core machine, where fp32 trains ~0.45 images/s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ALLOCATOR_VARIABLES, STABLE_ALLOCATOR, balanced_orders, environment, print_targets
from benchmarks.common import versus_plain, write_record

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """\
name: vs_plain
data:
  dataset: synthetic
  num_classes: 6
  synthetic_image_size: {crop}
  synthetic_train_size: 400
  synthetic_val_size: 2
  crop_size: {crop}
  scale_range: [0.5, 2.0]
  hflip: true
  num_workers: 1
model:
  arch: deeplabv3
  backbone: resnet50
  output_stride: 8
  pretrained_backbone: none
  norm: syncbn
  aux_loss: true
train:
  iters: {iters}
  batch_size: 4
  optimizer: sgd
  lr: 0.01
  momentum: 0.9
  weight_decay: 0.0001
  head_lr_mult: 1.0
  warmup_iters: 0
  poly_power: 0.9
  loss: [ce: 1.0]
  aux_weight: 0.5
  val_interval: {never}
  ckpt_interval: {never}
  log_interval: {window}
  num_vis_images: 0
"""


def run_product(config: Path, out_dir: Path, env: dict[str, str], overrides: list[str]) -> dict:
    command = [sys.executable, str(ROOT / "train.py"), "--config", str(config), f"output_dir={out_dir}", *overrides]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["images_per_s"] for r in records if r.get("type") == "train"]
    allocator = next((line for line in done.stderr.splitlines() + done.stdout.splitlines() if "allocator" in line
                      or "freed memory" in line), "")
    return {"images_per_s": rates, "log": allocator.strip()}


def run_plain(config: Path, out: Path, env: dict[str, str], iters: int, window: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.plain_loop", "--config", str(config), "--iters", str(iters),
               "--window", str(window), "--output", str(out)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every variant once")
    parser.add_argument("--window", type=int, default=3, help="iterations per timing window")
    parser.add_argument("--windows", type=int, default=2, help="timed windows per run (one more runs first)")
    parser.add_argument("--crop", type=int, default=256, help="crop (and synthetic image) size, pixels")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/bench_vs_plain.json)")
    args = parser.parse_args(argv)

    user_env = dict(os.environ)
    user_env.setdefault("PYTHONPATH", str(ROOT))
    kept_env = {**user_env, **STABLE_ALLOCATOR}
    iters = args.window * (args.windows + 1)
    rows: list[dict[str, float]] = []
    logs: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        config = tmp_path / "vs_plain.yaml"
        config.write_text(CONFIG.format(crop=args.crop, iters=iters, never=10 * iters, window=args.window))
        variants = {
            "syncseg_fp32": lambda out: run_product(config, out, user_env, ["train.amp=off", "model.channels_last=auto"]),
            "syncseg_fp32_nchw": lambda out: run_product(config, out, user_env, ["train.amp=off",
                                                                                 "model.channels_last=off"]),
            "syncseg_auto": lambda out: run_product(config, out, user_env, ["train.amp=auto", "model.channels_last=auto"]),
            "plain": lambda out: run_plain(config, out, user_env, iters, args.window),
            "plain_copy": lambda out: run_plain(config, out, user_env, iters, args.window),
            "plain_kept": lambda out: run_plain(config, out, kept_env, iters, args.window),
        }
        orders = balanced_orders(list(variants))
        for round_index in range(args.rounds):
            row: dict[str, float] = {}
            for name in orders[round_index % len(orders)]:
                result = variants[name](tmp_path / f"{name}_{round_index}" if name.startswith("syncseg")
                                        else tmp_path / f"{name}_{round_index}.json")
                rates = result["images_per_s"][1:]  # the first window holds start-up
                row[name] = statistics.mean(rates)
                if result.get("log"):
                    logs[name] = result["log"]
                print(f"round {round_index} {name:<13} {row[name]:.3f} img/s  (windows {[round(r, 3) for r in rates]})",
                      flush=True)
            rows.append(row)

    env = environment()
    print(f"\nDeepLabV3 / ResNet-50 OS8 + aux, batch 4, {args.crop} px crops, 1 loader worker, {args.rounds} rounds of "
          f"{args.windows} x {args.window} timed iterations; environment as started "
          f"({env['allocator']}; torch kernels {env['cpu_capability']}, bf16 flags {env['cpu_bf16'] or 'none'})")
    medians, targets = versus_plain(rows, list(variants), "vs plain")
    for name, line in logs.items():
        print(f"{name}: {line}")
    print_targets(targets)
    write_record("bench_vs_plain", args.output, {
        "benchmark": "bench_vs_plain", "rounds": rows, "medians_images_per_s": medians, "crop": args.crop,
        "window": args.window, "windows": args.windows, "logs": logs,
        "environment": environment(user_allocator_env={name: os.environ.get(name) for name in ALLOCATOR_VARIABLES}),
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
