"""Whole-scene prediction's memory and speed: predict.py on a 20,000 x 20,000 GeoTIFF against a 2,000 x 2,000 one.

    python -m benchmarks.bench_scene_predict            # 2k, 20k, then 2k again (the A/A control)
    python -m benchmarks.bench_scene_predict --large 8000 --workdir /tmp/scenes

Writes two 3-band uint8 scenes (a textured ground with bright "buildings" and a nodata frame, tiled, uncompressed,
built block by block), trains a checkpoint for 2 steps on the small one (the light model of configs/small_data.yaml:
the figure is about the pipeline, not the network), and runs `python -m syncseg predict --tile 512 --overlap 64`
on each as a separate process, as users run it (the default allocator settings of predict.py), reading the child's
peak resident memory from the kernel (wait4's ru_maxrss). Target: the large scene's peak RSS within 10% of the
small one's. The throughput is the scene's megapixels over the seconds predict.py reports for it (reading,
network, blending and writing; the COG rewrite after it is not counted).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import environment, judge, print_targets, write_record

REPO = Path(__file__).resolve().parents[1]
TILE, OVERLAP = 512, 64
BLOCK = 1024  # rows written at a time when the scene is made


def write_scene(path: Path, size: int, *, seed: int = 0) -> None:
    """A size x size x 3 uint8 GeoTIFF (UTM 33N, 0.3 m pixels) with a 64-pixel nodata (0) frame."""
    import rasterio
    from rasterio.transform import from_origin
    from rasterio.windows import Window

    rng = np.random.default_rng(seed)
    texture = rng.integers(40, 120, (3, BLOCK, BLOCK + 509), dtype=np.uint8)
    for _ in range(60):  # buildings in the texture, so the network sees both classes
        top, left, side = int(rng.integers(0, BLOCK - 40)), int(rng.integers(0, BLOCK)), int(rng.integers(12, 40))
        texture[:, top:top + side, left:left + side] = 220
    profile = {"driver": "GTiff", "width": size, "height": size, "count": 3, "dtype": "uint8", "nodata": 0,
               "crs": "EPSG:32633", "transform": from_origin(500000, 4200000, 0.3, 0.3), "tiled": True,
               "blockxsize": 512, "blockysize": 512, "BIGTIFF": "IF_SAFER"}
    frame = 64
    with rasterio.open(path, "w", **profile) as sink:
        for top in range(0, size, BLOCK):
            rows = min(BLOCK, size - top)
            shift = (top // BLOCK * 211) % 509
            block = np.concatenate([np.roll(texture[:, :rows], -shift, axis=2)] * (size // BLOCK + 2), axis=2)
            block = np.ascontiguousarray(block[:, :, :size])
            block[:, :, :frame] = 0
            block[:, :, size - frame:] = 0
            row_index = np.arange(top, top + rows)
            block[:, (row_index < frame) | (row_index >= size - frame)] = 0
            sink.write(block, window=Window(0, top, size, rows))


def write_labels(image: Path, path: Path) -> None:
    """Its label raster: the bright pixels are buildings."""
    import rasterio

    with rasterio.open(image) as source:
        labels = (source.read(1) > 200).astype(np.uint8)
        profile = {**source.profile, "count": 1, "nodata": None}
    with rasterio.open(path, "w", **profile) as sink:
        sink.write(labels[None])


def train_checkpoint(folder: Path) -> Path:
    run = folder / "run"
    command = [sys.executable, str(REPO / "train.py"), "--config", "small_data.yaml", f"output_dir={run}",
               "--overwrite", "data.dataset=raster", f"data.root={folder}", "data.scenes=[scene_small.tif]",
               "data.labels=[labels_small.tif]", "data.num_classes=2", "data.class_names=[ground,building]",
               "data.crop_size=128", "train.iters=2", "train.val_interval=2", "train.ckpt_interval=2",
               "data.num_workers=0", "data.chips_per_epoch=16", "data.mean=[0.3,0.3,0.3]", "data.std=[0.2,0.2,0.2]"]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return run / "best.pt"


def predict(checkpoint: Path, scene: Path, output: Path, amp: str) -> dict[str, float]:
    """One predict.py process on `scene`: its peak RSS (MiB), the seconds it reports, its wall time."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "syncseg", "predict", "--checkpoint", str(checkpoint),
                                "--input", str(scene), "--output", str(output), "--tile", str(TILE), "--overlap",
                                str(OVERLAP), "--device", "cpu", "--amp", amp], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, cwd=REPO, text=True)
    text = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"predict.py failed on {scene}:\n{text[-3000:]}")
    found = re.search(r"(\d+) tiles of .* in ([\d.]+) s, ([\d.]+) megapixels/s", text)
    if not found:
        raise RuntimeError(f"predict.py's summary line is missing:\n{text[-3000:]}")
    return {"peak_rss_mib": usage.ru_maxrss / 1024, "seconds": float(found.group(2)),
            "megapixels_per_s": float(found.group(3)), "tiles": int(found.group(1)), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=2000, help="side of the small scene (pixels)")
    parser.add_argument("--large", type=int, default=20000, help="side of the large scene (pixels)")
    parser.add_argument("--amp", default="auto", help="predict.py --amp: auto (bf16 where the CPU has it) or off")
    parser.add_argument("--workdir", help="folder for the scenes (default: a temporary one, deleted after)")
    parser.add_argument("--output", default=None,
                        help="JSON path (default benchmarks/results/bench_scene_predict[_off].json)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as temporary:
        folder = Path(temporary)
        started = time.perf_counter()
        scenes = {"small": folder / "scene_small.tif", "large": folder / "scene_large.tif"}
        write_scene(scenes["small"], args.small)
        write_scene(scenes["large"], args.large, seed=1)
        write_labels(scenes["small"], folder / "labels_small.tif")
        checkpoint = train_checkpoint(folder)
        print(f"scenes and checkpoint made in {time.perf_counter() - started:.0f} s")
        rows = {}
        for name, scene in (("small", scenes["small"]), ("large", scenes["large"]), ("small_again", scenes["small"])):
            rows[name] = predict(checkpoint, scene, folder / f"out_{name}", args.amp)
            print(f"  {name:<12} done: {rows[name]}", flush=True)
    sides = {"small": args.small, "large": args.large, "small_again": args.small}
    print(f"\nscene prediction, predict.py --tile {TILE} --overlap {OVERLAP} --amp {args.amp}, light model "
          "(configs/small_data.yaml), 3-band uint8 GeoTIFFs")
    print(f"{'scene':<12} {'pixels':>13} {'tiles':>6} {'seconds':>8} {'MP/s':>6} {'peak RSS MiB':>13} {'x small':>8}")
    for name, row in rows.items():
        print(f"{name:<12} {sides[name]:>6}x{sides[name]:<6} {row['tiles']:6d} {row['seconds']:8.1f} "
              f"{row['megapixels_per_s']:6.2f} {row['peak_rss_mib']:13.0f} "
              f"{row['peak_rss_mib'] / rows['small']['peak_rss_mib']:8.3f}")
    ratio = rows["large"]["peak_rss_mib"] / rows["small"]["peak_rss_mib"]
    control = rows["small_again"]["peak_rss_mib"] / rows["small"]["peak_rss_mib"]
    targets = [judge(f"peak RSS, {args.large} px scene / {args.small} px scene", {"median": ratio}, target=1.10,
                     control=None)]
    print_targets(targets)
    print(f"A/A (the small scene again / the small scene): {control:.3f}")
    name = "bench_scene_predict" if args.amp == "auto" else f"bench_scene_predict_{args.amp}"
    write_record(name, args.output, {
        "environment": environment(amp=args.amp), "rows": rows, "sides": sides, "tile": TILE, "overlap": OVERLAP,
        "control": control, "targets": targets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
