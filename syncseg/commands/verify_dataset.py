"""Check a dataset before training: sample counts, readable files, matching sizes, label ranges, and
per-class pixel frequencies (with median-frequency class weights usable as train.class_weights). Like
the start of training, it also looks at a sample of masks for encodings that train wrong (binary 0/255
masks whose foreground is the ignore label, grey-level-coded classes, multi-page files) and at the split's
listing (names listed twice, two images of one name), and prints the config that reads them (WARNING
lines: the start of training's warnings, from the same functions in syncseg.data.checks and
syncseg.data.masks).

The images are described as their files store them (channels, bit depth, value range), whatever the config
says (a TIFF of more bands than the 8-bit RGB reader takes is a bad sample under that config, and is
described all the same), and one set of config lines reads them and normalizes them by their own
per-channel mean and std (data.in_channels, data.max_value, data.mean, data.std; train.class_weights): the
training split's, with the other splits' figures beside them as comments. It runs without data.mean and
data.std (it measures them). A WARNING says when the config reads the images otherwise (e.g. 16-bit or
2-channel files read as 8-bit RGB), naming the files; an unreadable file is one BAD line naming it and why,
without the image libraries' own log lines.

    python -m syncseg verify --config voc.yaml data.root=/data/VOCdevkit/VOC2012
    python -m syncseg verify --config cityscapes.yaml --splits val --workers 8 --output stats.json
    python -m syncseg verify --config ade20k.yaml data.root=/data/ADEChallengeData2016

Exit status and error lines: syncseg/engine/cli.py (0 every sample is good; 1 some are bad (each is listed),
or --output cannot be written (named); 2 the dataset or config cannot be opened, or an annotation export
(data.dataset coco, labelme, cvat, yolo_seg, label_studio) has problems the start of training refuses: each is a
BAD line naming the file and the annotation). A count that
differs from the official one is reported, not an error.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from syncseg.data.statistics import ChannelStats, verify_split

# numpy, torch and the data package's datasets are imported where used, so that --help answers at once.

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


def _listed(values: list[float]) -> str:
    return ",".join(f"{value:g}" for value in values)


def _bracketed(values: list[float]) -> str:
    return f"[{_listed(values)}]"


def print_image_formats(formats: dict[tuple[int, int], ChannelStats], data_cfg: Any, *,
                        description: str) -> list[str]:
    """Print the images' stored formats, and a WARNING for each format the config reads otherwise
    (syncseg.data.checks.image_format_warnings, as the start of training says it); returns the warnings."""
    from syncseg.data.checks import StoredFormat, image_format_warnings
    from syncseg.data.images import ImageFormat

    for stats in formats.values():
        print(f"  images as stored: {stats.describe()}")
    warnings = image_format_warnings(
        [StoredFormat(item.channels, item.bits, float(item.high.max()), item.paths) for item in formats.values()],
        ImageFormat.of(data_cfg), description=description)
    for warning in warnings:
        print(f"  WARNING: {warning}")
    return warnings


def main_format(formats: dict[tuple[int, int], ChannelStats]) -> ChannelStats | None:
    """The stored format of most of a split's images (None when none was read)."""
    return max(formats.values(), key=lambda item: item.num_images) if formats else None


def print_config_lines(source: str, formats: dict[str, dict[tuple[int, int], ChannelStats]],
                       weights: dict[str, list[float]], *, note: str = "") -> dict[str, Any] | None:
    """Print one set of config lines, from the split `source` (the training split): data.in_channels,
    max_value, mean and std of its most common stored format, and its median-frequency class weights, with
    the other splits' figures beside them as comments, for comparison only. Returns the lines as a dict
    (None, after saying why, when no image of `source` could be read)."""
    chosen = main_format(formats[source])
    if chosen is None:
        print(f"no config lines: no image of split '{source}' could be read{note}")
        return None
    lines = chosen.config()
    others = {split: main_format(found).config() for split, found in formats.items()
              if split != source and main_format(found) is not None}

    def beside(key: str) -> str:
        shown = [f"{split}: {_bracketed(other[key]) if isinstance(other[key], list) else other[key]}"
                 for split, other in others.items()]
        return "; ".join(shown)

    which = "its most common format" if len(formats[source]) > 1 else f"its {chosen.num_images} image(s)"
    compared = ", other splits' figures beside them for comparison only" if others else ""
    more = {key: f"; {beside(key)}" if others else "" for key in ("mean", "std")}
    print(f"config lines from split '{source}' ({which}{compared}){note}:\n  data:")
    for key in ("in_channels", "max_value"):
        print(f"    {key}: {lines[key]}" + (f"    # {beside(key)}" if others else ""))
    print(f"    mean: [{_listed(lines['mean'])}]    # x / max_value; in the images' units: "
          f"{lines['mean_in_image_units']}{more['mean']}\n"
          f"    std: [{_listed(lines['std'])}]    # in the images' units: {lines['std_in_image_units']}{more['std']}")
    class_weights = weights[source]
    compared_weights = "; ".join(f"{split}: {_bracketed(found)}" for split, found in weights.items() if split != source)
    print("  train:    # optional, for imbalanced classes: median-frequency weights of the ce and focal losses\n"
          f"    class_weights: [{_listed(class_weights)}]" + (f"    # {compared_weights}" if compared_weights else ""))
    print(f"  command line: data.in_channels={lines['in_channels']} data.max_value={lines['max_value']} "
          f"data.mean={_listed(lines['mean'])} data.std={_listed(lines['std'])}")
    print(f"  optional: train.class_weights={_listed(class_weights)}")
    return {"split": source, "data": {key: lines[key] for key in ("in_channels", "max_value", "mean", "std")},
            "train": {"class_weights": class_weights}}


def print_classes(source: str, report: dict[str, dict[str, Any]]) -> None:
    """One table: the split `source`'s class pixels, frequencies and median-frequency weights, and the other
    splits' frequencies beside them."""
    stats = report[source]
    others = [split for split in report if split != source]
    print(f"classes of split '{source}'" + (f", with the frequency in {', '.join(repr(s) for s in others)}"
                                             if others else "") + ":")
    print(f"  {'id':>3} {'class':<22} {'pixels':>14} {'frequency':>10} {'weight':>8}"
          + "".join(f" {split[:14] + ' freq.':>20}" for split in others))
    for index, name in enumerate(stats["classes"]):
        print(f"  {index:>3} {name:<22} {stats['class_pixels'][index]:>14} {stats['class_frequency'][index]:>10.5f} "
              f"{stats['median_frequency_weights'][index]:>8.3f}"
              + "".join(f" {report[split]['class_frequency'][index]:>20.5f}" for split in others))
    for split, found in report.items():
        missing = [name for name, count in zip(found["classes"], found["class_pixels"]) if count == 0]
        if missing:
            print(f"  classes with no pixels in split '{split}': {', '.join(missing)}")


def write_report(output: str, report: dict[str, Any]) -> None:
    """The report as JSON at `output` (when given), atomically: an earlier file there stays whole on failure."""
    if not output:
        return
    from syncseg.engine.atomic import write_atomically
    from syncseg.engine.cli import writing

    text = json.dumps(report, indent=2).encode()
    with writing("statistics", output):
        write_atomically(Path(output), lambda file: file.write(text), what="statistics")
    print(f"wrote {output}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config name in configs/ or a YAML path")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides, e.g. data.root=/data/VOC2012")
    parser.add_argument("--splits", default="", help="comma-separated splits (default: data.train_split,data.val_split)")
    parser.add_argument("--workers", type=int, default=0, help="decoding processes")
    parser.add_argument("--limit", type=int, default=0, help="check only the first N samples of each split")
    parser.add_argument("--output", default="", help="also write the statistics as JSON here")
    args = parser.parse_args(argv)
    from syncseg.engine.cli import run_command

    return run_command("syncseg-verify", lambda: verify(args))


def verify(args: argparse.Namespace) -> int:
    """Check the splits `args` name and print the report; returns 0, or 1 when some sample is bad.
    FileNotFoundError / ValueError when the config or a dataset cannot be opened."""
    from syncseg.data import SegmentationDataset, build_dataset
    from syncseg.data.annotations.common import AnnotationError
    from syncseg.data.annotations.dataset import AnnotatedSegmentation
    from syncseg.data.base import START_CHECK_MASKS
    from syncseg.engine.config import load_config

    config = load_config(args.config, args.overrides, normalization_unknown=True)  # it measures mean and std
    data_cfg = config.data
    if data_cfg.dataset == "raster":  # scenes, not samples: syncseg.data.raster.inspect
        from syncseg.data.raster.inspect import describe

        lines, report = describe(data_cfg)
        print("\n".join(lines))
        write_report(args.output, report)
        return 1 if any("BAD:" in line for line in lines) else 0
    splits = [s for s in args.splits.split(",") if s] or list(dict.fromkeys([data_cfg.train_split,
                                                                                data_cfg.val_split]))
    datasets = {}
    for split in splits:
        try:
            datasets[split] = build_dataset(data_cfg, split, train=False)
        except AnnotationError as error:  # every problem of the export on a line of its own, then exit 2
            for problem in error.problems:
                print(f"  BAD: {problem}")
            raise
    report: dict[str, Any] = {"dataset": data_cfg.dataset, "root": data_cfg.root, "splits": {}}
    formats: dict[str, dict[tuple[int, int], ChannelStats]] = {}
    total_bad = bad_annotations = 0
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
        formats[split] = stats.pop("image_formats")
        description = getattr(dataset, "description", f"{data_cfg.dataset} {split}")
        stats["image_warnings"] = print_image_formats(formats[split], data_cfg, description=description)
        stats["image_formats"] = [{**item.config(), "bits": item.bits, "num_images": item.num_images,
                                   "value_range": [item.low.tolist(), item.high.tolist()]}
                                  for item in formats[split].values()]
        if isinstance(dataset, AnnotatedSegmentation):  # every shape of every sample, one line per problem
            shapes = dataset.inspect_masks(args.limit, every_line=True)
            stats["warnings"] = [*dataset.listing_warnings, *shapes.warnings]
            stats["bad_annotations"] = shapes.bad
            bad_annotations += len(shapes.bad)
            for message in shapes.bad:
                print(f"  BAD: {message}")
            for message in stats["warnings"]:
                print(f"  WARNING: {message}")
        elif isinstance(dataset, SegmentationDataset):  # the start of training's look at the listing and the masks
            stats["warnings"] = [*dataset.listing_warnings, *dataset.inspect_masks(START_CHECK_MASKS).warnings]
            for message in stats["warnings"]:
                print(f"  WARNING: {message}")
    # one set of lines, from the split training reads: a second set per split would be copied by whoever
    # reads last
    source = data_cfg.train_split if data_cfg.train_split in report["splits"] else splits[0]
    note = "" if source == data_cfg.train_split else f" (the training split '{data_cfg.train_split}' was not checked)"
    print_classes(source, report["splits"])
    report["config_lines"] = print_config_lines(
        source, formats, {split: stats["median_frequency_weights"] for split, stats in report["splits"].items()},
        note=note)
    write_report(args.output, report)
    if bad_annotations:  # what the start of training refuses: bad input, as for a malformed export
        print(f"{bad_annotations} sample(s) with bad annotations (BAD lines above): training refuses them at start")
        return 2
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
