"""Check a dataset before training: sample counts, readable files, matching sizes, label ranges, and
per-class pixel frequencies (with median-frequency class weights usable as train.class_weights). Like
the start of training, it also looks at a sample of masks for encodings that train wrong (binary 0/255
masks whose foreground is the ignore label, grey-level-coded classes) and prints the config that reads
them (WARNING lines).

    python scripts/verify_dataset.py --config voc.yaml data.root=/data/VOCdevkit/VOC2012
    python scripts/verify_dataset.py --config cityscapes.yaml --splits val --workers 8 --output stats.json
    python scripts/verify_dataset.py --config ade20k.yaml data.root=/data/ADEChallengeData2016

Exit status and error lines: engine/cli.py (0 every sample is good; 1 some are bad (each is listed),
or --output cannot be written (named); 2 the dataset or config cannot be opened). A count that
differs from the official one is reported, not an error.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# numpy, torch and the data package are imported where used, so that --help answers at once.

# Official sizes of complete datasets: (dataset, split) -> images
EXPECTED_COUNTS = {
    ("voc", "train"): 1464,
    ("voc", "val"): 1449,
    ("voc", "trainval"): 2913,
    ("voc", "train_aug"): 10582,
    ("cityscapes", "train"): 2975,
    ("cityscapes", "val"): 500,
    ("ade20k", "training"): 20210,
    ("ade20k", "validation"): 2000,
}


class _Stats:
    """Per-sample statistics (or the error) computed in loader workers (a map-style dataset)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import numpy as np

        from data import BadSampleError

        try:
            image, mask = self.dataset.load(index)
        except (BadSampleError, OSError) as error:
            return {"index": index, "error": str(error)}
        return {"index": index, "height": image.shape[0], "width": image.shape[1],
                "counts": np.bincount(mask.ravel(), minlength=256)}


def verify_split(dataset: Any, *, workers: int = 0, limit: int = 0) -> dict[str, Any]:
    """Statistics of one split: counts, size range, class pixel counts, bad samples."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    indices = range(min(len(dataset), limit) if limit > 0 else len(dataset))
    loader = DataLoader(torch.utils.data.Subset(_Stats(dataset), list(indices)), batch_size=None,
                        num_workers=workers)
    pixels = np.zeros(256, dtype=np.int64)
    bad, heights, widths = [], [], []
    for item in loader:
        if "error" in item:
            bad.append(item["error"])
            continue
        heights.append(item["height"])
        widths.append(item["width"])
        pixels += np.asarray(item["counts"], dtype=np.int64)
    num_classes = dataset.num_classes
    class_pixels = pixels[:num_classes]
    frequencies = class_pixels / max(1, class_pixels.sum())
    present = frequencies > 0
    weights = np.zeros(num_classes)
    if present.any():
        weights[present] = np.median(frequencies[present]) / frequencies[present]
    return {
        "num_samples": len(dataset),
        "num_checked": len(indices),
        "num_bad": len(bad),
        "bad": bad,
        "height_range": [min(heights), max(heights)] if heights else None,
        "width_range": [min(widths), max(widths)] if widths else None,
        "ignore_pixels": int(pixels[dataset.ignore_index]),
        "classes": list(dataset.classes),
        "class_pixels": class_pixels.tolist(),
        "class_frequency": frequencies.tolist(),
        "median_frequency_weights": weights.round(4).tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config name in configs/ or a YAML path")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides, e.g. data.root=/data/VOC2012")
    parser.add_argument("--splits", default="", help="comma-separated splits (default: data.train_split,data.val_split)")
    parser.add_argument("--workers", type=int, default=0, help="decoding processes")
    parser.add_argument("--limit", type=int, default=0, help="check only the first N samples of each split")
    parser.add_argument("--output", default="", help="also write the statistics as JSON here")
    args = parser.parse_args(argv)
    from engine.cli import run_command

    return run_command("verify_dataset.py", lambda: verify(args))


def verify(args: argparse.Namespace) -> int:
    """Check the splits `args` name and print the report; returns 0, or 1 when some sample is bad.
    FileNotFoundError / ValueError when the config or a dataset cannot be opened."""
    from data import SegmentationDataset, build_dataset
    from data.base import START_CHECK_MASKS
    from engine.atomic import write_atomically
    from engine.cli import writing
    from engine.config import load_config

    config = load_config(args.config, args.overrides)
    data_cfg = config.data
    splits = [s for s in args.splits.split(",") if s] or list(dict.fromkeys([data_cfg.train_split,
                                                                                data_cfg.val_split]))
    datasets = {split: build_dataset(data_cfg, split, train=False) for split in splits}
    report: dict[str, Any] = {"dataset": data_cfg.dataset, "root": data_cfg.root, "splits": {}}
    total_bad = 0
    for split, dataset in datasets.items():
        stats = verify_split(dataset, workers=args.workers, limit=args.limit)
        # the dataset's own name for the split (ADE20K: train -> training)
        expected = EXPECTED_COUNTS.get((data_cfg.dataset, getattr(dataset, "split", split)))
        stats["expected_samples"] = expected
        report["splits"][split] = stats
        total_bad += stats["num_bad"]
        count_note = ""
        if expected is not None:
            count_note = " (complete)" if stats["num_samples"] == expected else f" (INCOMPLETE: the full split has {expected})"
        print(f"[{data_cfg.dataset} {split}] {stats['num_samples']} samples{count_note}; checked {stats['num_checked']}, "
              f"bad {stats['num_bad']}; height {stats['height_range']}, width {stats['width_range']}; "
              f"ignore ({dataset.ignore_index}) pixels {stats['ignore_pixels']}")
        for message in stats["bad"]:
            print(f"  BAD: {message}")
        if isinstance(dataset, SegmentationDataset):  # the start of training's look at the masks
            stats["warnings"] = dataset.inspect_masks(START_CHECK_MASKS).warnings
            for message in stats["warnings"]:
                print(f"  WARNING: {message}")
        print(f"  {'id':>3} {'class':<22} {'pixels':>14} {'frequency':>10} {'weight':>8}")
        for index, name in enumerate(stats["classes"]):
            print(f"  {index:>3} {name:<22} {stats['class_pixels'][index]:>14} "
                  f"{stats['class_frequency'][index]:>10.5f} {stats['median_frequency_weights'][index]:>8.3f}")
        missing = [name for name, count in zip(stats["classes"], stats["class_pixels"]) if count == 0]
        if missing:
            print(f"  classes with no pixels: {', '.join(missing)}")
    if args.output:
        text = json.dumps(report, indent=2).encode()
        with writing("statistics", args.output):  # atomically: an earlier file there stays whole on failure
            write_atomically(Path(args.output), lambda file: file.write(text), what="statistics")
        print(f"wrote {args.output}")
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
