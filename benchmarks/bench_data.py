"""Input-pipeline throughput: the full training pipeline vs decoding alone, same files, same process.

Generates VOC-layout 500x375 JPEG + palette-PNG pairs (synthetic shapes) in a temporary folder, then
times, interleaved over several rounds (one pass over all pairs per variant per round):
  decode_only   cv2 JPEG decode (RGB) + PIL palette-PNG decode (indices)
  train         VOCSegmentation with the trainer's pipeline (scale 0.5-2.0, pad, 513 crop, flip) -> uint8 image
                and uint8 mask tensors (the trainer's loader keeps masks uint8 until the device: syncseg.engine.build)
  train_int64   the same with int64 masks, what a dataset gives by default (a user's own loop)
  train_batch / train_int64_batch   train / train_int64 plus the loader's collation of batches of 8 with
                its mask-value check (syncseg.engine.samplers.MaskCheckingCollate): a worker's whole work
  train_photo   the trainer's pipeline plus photometric jitter / blur
  pil_mask / cv2_mask    mask decoders alone (PIL keeps palette indices; cv2 needs an 'L' PNG)
  synthetic_96  generating one 96x96 synthetic-shapes sample (the demo's data; target well under 2 ms)
  coco_load     the same images with their masks as COCO polygons (data.dataset=coco: each class's region cut
                by a 2 x 2 grid, each piece traced as a polygon of every boundary pixel, ~7 per image, holes left
                out), JPEG decode + drawing the polygons (pycocotools)
  coco_train    coco_load through the trainer's pipeline: what a worker does per sample with a COCO export
Reports median ms/image, images/s and the median of per-round ratios to decode_only, beside the A/A
control decode_only_copy / decode_only (a verdict needs it within 1.02; benchmarks/common.py).
Targets: train <= 2.0x decode_only (issue 5); coco_train <= 2.0x decode_only (issue 48: masks drawn from
COCO polygons on the fly cost no more than the PNG masks they replace).

    python -m benchmarks.bench_data [--images 32] [--rounds 40] [--crop 513] [--output PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
import torch
from PIL import Image

from benchmarks.common import environment, judge, paired, print_targets, stable_allocator, time_interleaved
from benchmarks.common import write_record
from syncseg.data.base import palette_image, read_image, read_index_mask
from syncseg.data.registry import build_dataset
from syncseg.data.synthetic import SyntheticShapes, render_shapes
from syncseg.data.transforms import PairTransform, build_train_augmentation
from syncseg.engine.config import DataConfig
from syncseg.engine.samplers import MaskCheckingCollate
from syncseg.data.voc import VOC_PALETTE, VOCSegmentation


def make_pairs(root: Path, count: int) -> list[str]:
    """VOC-layout tree of `count` 500x375 JPEG + palette-PNG (and 'L' PNG copies for cv2_mask)."""
    for folder in ("JPEGImages", "SegmentationClass", "MasksL", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    names = []
    for index in range(count):
        image, mask = render_shapes(np.random.default_rng(index), 500, num_classes=8)
        image, mask = image[:375], (mask[:375] * 2).astype(np.uint8)
        mask[:, :3] = 255
        name = f"bench_{index:05d}"
        cv2.imwrite(str(root / "JPEGImages" / f"{name}.jpg"), cv2.cvtColor(image, cv2.COLOR_RGB2BGR),
                    [cv2.IMWRITE_JPEG_QUALITY, 90])
        palette_image(mask, VOC_PALETTE).save(root / "SegmentationClass" / f"{name}.png")
        Image.fromarray(mask, mode="L").save(root / "MasksL" / f"{name}.png")
        names.append(name)
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("\n".join(names) + "\n")
    return names


def make_coco_export(root: Path, names: list[str]) -> int:
    """annotations/instances_train.json over the JPEGs of `names`: each class of each palette mask cut by a 2 x 2
    grid, each connected piece one polygon of every boundary pixel (as tools trace masks; about 7 per image,
    COCO's own mean is 7.3 objects); returns the number of polygons."""
    import json

    images, annotations, count = [], [], 0
    for number, name in enumerate(names):
        mask = read_index_mask(root / "SegmentationClass" / f"{name}.png")
        images.append({"id": number, "file_name": f"JPEGImages/{name}.jpg", "height": mask.shape[0],
                       "width": mask.shape[1]})
        height, width = mask.shape
        for value in np.unique(mask):
            if value in (0, 255):
                continue
            for top, left in ((0, 0), (0, width // 2), (height // 2, 0), (height // 2, width // 2)):
                cell = np.zeros_like(mask)
                box = (slice(top, top + height // 2), slice(left, left + width // 2))
                cell[box] = mask[box] == value
                contours, _ = cv2.findContours(cell, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
                for contour in contours:
                    if len(contour) >= 3:
                        ring = (contour.reshape(-1, 2) + 0.5).reshape(-1).tolist()
                        annotations.append({"id": len(annotations) + 1, "image_id": number,
                                            "category_id": int(value), "iscrowd": 0, "segmentation": [ring]})
                        count += 1
    categories = [{"id": value, "name": f"class_{value}"} for value in range(1, 21)]
    (root / "annotations").mkdir(exist_ok=True)
    (root / "annotations" / "instances_train.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": categories}))
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=32, help="number of generated 500x375 image/mask pairs")
    parser.add_argument("--rounds", type=int, default=40,
                        help="interleaved rounds, one pass per variant each (10 make one balanced cycle)")
    parser.add_argument("--crop", type=int, default=513, help="training crop size of the pipeline, pixels")
    parser.add_argument("--threads", type=int, default=1, help="cv2 / torch threads (a DataLoader worker uses 1)")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/bench_data.json)")
    args = parser.parse_args(argv)
    cv2.setNumThreads(args.threads)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = make_pairs(root, args.images)
        jpgs = [root / "JPEGImages" / f"{n}.jpg" for n in names]
        pngs = [root / "SegmentationClass" / f"{n}.png" for n in names]
        l_pngs = [root / "MasksL" / f"{n}.png" for n in names]
        train, train_int64 = (VOCSegmentation(root, "train", transform=PairTransform(
            build_train_augmentation(args.crop, (0.5, 2.0), hflip=True), random=True, compact_masks=compact))
            for compact in (True, False))
        photo = VOCSegmentation(root, "train", transform=PairTransform(
            build_train_augmentation(args.crop, (0.5, 2.0), hflip=True, photometric=True), random=True,
            compact_masks=True))
        collate = MaskCheckingCollate(num_classes=21, ignore_index=255)
        num_polygons = make_coco_export(root, names)
        coco_settings = DataConfig(dataset="coco", root=str(root), crop_size=(args.crop, args.crop))
        coco_load = build_dataset(coco_settings, "train", train=False)
        coco_train = build_dataset(coco_settings, "train", train=True, compact_masks=True)

        def batches(dataset):
            samples = [dataset[i] for i in range(len(dataset))]
            return [collate(samples[start:start + 8]) for start in range(0, len(samples), 8)]

        def decode_only():
            for jpg, png in zip(jpgs, pngs):
                read_image(jpg)
                read_index_mask(png)

        synthetic = SyntheticShapes(len(names), 96, split="bench", cache_bytes=0)  # time rendering, not the cache
        variants = {
            "decode_only": decode_only,
            "decode_only_copy": decode_only,
            "train": lambda: [train[i] for i in range(len(train))],
            "train_int64": lambda: [train_int64[i] for i in range(len(train_int64))],
            "train_batch": lambda: batches(train),
            "train_int64_batch": lambda: batches(train_int64),
            "train_photo": lambda: [photo[i] for i in range(len(photo))],
            "pil_mask": lambda: [read_index_mask(p) for p in pngs],
            "cv2_mask": lambda: [cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in l_pngs],
            "synthetic_96": lambda: [synthetic.load(i) for i in range(len(synthetic))],
            "coco_load": lambda: [coco_load.load(i) for i in range(len(coco_load))],
            "coco_train": lambda: [coco_train[i] for i in range(len(coco_train))],
        }
        times = time_interleaved(variants, args.rounds)  # seconds per pass over all pairs
        times = {name: [value / len(names) for value in values] for name, values in times.items()}

    rows = []
    for name, values in times.items():
        ratios = [v / d for v, d in zip(values, times["decode_only"])]
        rows.append({
            "variant": name,
            "ms_per_image": statistics.median(values) * 1e3,
            "images_per_s": 1.0 / statistics.median(values),
            "ratio_to_decode_only": statistics.median(ratios),
        })
    print(f"{args.images} pairs of 500x375 JPEG + palette PNG, crop {args.crop}, scale 0.5-2.0, "
          f"{args.rounds} interleaved rounds, {args.threads} thread(s); medians; coco_*: the same images with "
          f"{num_polygons / len(names):.1f} COCO polygons each")
    print(f"{'variant':<17} {'ms/image':>9} {'images/s':>9} {'x decode':>9}")
    for row in rows:
        print(f"{row['variant']:<17} {row['ms_per_image']:>9.2f} {row['images_per_s']:>9.1f} "
              f"{row['ratio_to_decode_only']:>9.2f}")
    control = paired(times["decode_only_copy"], times["decode_only"])
    targets = [judge("data train/decode_only", paired(times["train"], times["decode_only"]), target=2.0,
                     control=control),
               judge("data coco_train/decode_only", paired(times["coco_train"], times["decode_only"]), target=2.0,
                     control=control)]
    print_targets(targets)
    write_record("bench_data", args.output, {
        "rows": rows, "raw_seconds_per_image": times, "images": args.images, "rounds": args.rounds,
        "crop": args.crop, "threads": args.threads, "opencv": cv2.__version__, "coco_polygons": num_polygons,
        "environment": environment(), "targets": targets,
    })
    return 0


if __name__ == "__main__":
    stable_allocator("benchmarks.bench_data", sys.argv[1:])  # re-executes once, when run as a program
    sys.exit(main())
