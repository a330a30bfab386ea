"""Evaluate a checkpoint: mIoU, per-class IoU, pixel / mean accuracy, frequency-weighted IoU.

    python eval.py --checkpoint runs/voc/best.pt [--device cpu|cuda:0] [--split val] [--mode whole|slide]
                   [--scales 0.5,0.75,1.0,1.25,1.5,1.75] [--flip] [--save-predictions DIR]
                   [--output metrics.json] [KEY=VALUE ...]
    torchrun --nproc_per_node 4 eval.py --checkpoint ... (disjoint shards, one all-reduced matrix)

The model is rebuilt from the config stored in the checkpoint; KEY=VALUE overrides (e.g.
data.root=/data/VOCdevkit/VOC2012) and the flags above apply on top of it.

Exit status and error lines: syncseg/engine/cli.py (2: missing files, a checkpoint whose classes or
architecture do not match the config; 1: a report or prediction that cannot be written, named).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

# the standard library only
from syncseg.engine.cli import TIME_FORMAT, add_runtime_arguments, run_command, runtime_choice, writing

# The engine (torch, torchvision, albumentations) is imported after the arguments are parsed, so that
# --help and argument errors answer at once.

logger = logging.getLogger("eval")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Evaluate a syncseg checkpoint on one device (or sharded under torchrun).",
        epilog="Example: python eval.py --checkpoint runs/voc/best.pt --mode slide --scales 0.75,1.0,1.25 --flip "
               "data.root=/data/VOCdevkit/VOC2012",
    )
    parser.add_argument("--checkpoint", required=True, help="best.pt or last.pt written by train.py (or a "
                                                            ".safetensors file from `python -m syncseg export`)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available, else cpu; "
                                         "under torchrun each process uses cuda:LOCAL_RANK)")
    parser.add_argument("--split", help="dataset split to evaluate (default: the config's data.val_split)")
    parser.add_argument("--mode", help="whole (the full image) or slide (windows of eval.window_size every "
                                       "eval.stride pixels); default: the checkpoint's eval.mode")
    parser.add_argument("--scales", help="comma-separated test scales, e.g. 0.5,0.75,1.0,1.25,1.5,1.75")
    parser.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                        help="also predict the horizontally flipped image and average the logits")
    parser.add_argument("--amp", help="precision for inference: auto, off, tf32, fp16 or bf16 (default: the checkpoint's "
                                      "eval.amp, which training's validation also uses, so both report the "
                                      "same numbers)")
    add_runtime_arguments(parser)
    parser.add_argument("--save-predictions", metavar="DIR",
                        help="write DIR/color/<name>.png (palette) and DIR/labels/<name>.png (class ids; "
                             "Cityscapes: labelIds, ADE20K: 1..150, as the benchmark servers expect)")
    parser.add_argument("--output", metavar="JSON", help="write the metrics and the evaluation protocol here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--print-config", action="store_true",
                        help="print the config this command would evaluate with (the checkpoint's, with the "
                             "overrides and flags applied, every key) as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides on top of the checkpoint's config, e.g. data.root=/data/VOC2012")
    return parser.parse_intermixed_args(argv)  # overrides may come before, between or after the options


def check_classes(checkpoint: str, checkpoint_classes: list[str], dataset: Any, data_cfg: Any, split: str) -> None:
    """ValueError when the dataset's class count differs from the checkpoint's; a warning when only names do."""
    dataset_classes = list(dataset.classes)
    if len(checkpoint_classes) != len(dataset_classes):
        def short(names: list[str]) -> str:
            return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")

        raise ValueError(
            f"checkpoint '{checkpoint}' predicts {len(checkpoint_classes)} classes ({short(checkpoint_classes)}) "
            f"but data.dataset={data_cfg.dataset} split '{split}' has {len(dataset_classes)} "
            f"({short(dataset_classes)}); evaluate on the dataset the model was trained for"
        )
    if checkpoint_classes != dataset_classes:
        logger.warning("class names differ between the checkpoint (%s) and the dataset (%s); evaluating by index",
                       ", ".join(checkpoint_classes), ", ".join(dataset_classes))


def _plain(value: Any) -> Any:
    """JSON-safe: nan -> None (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def format_table(classes: list[str], metrics: dict[str, Any]) -> str:
    """Per-class IoU / accuracy table (n/a for classes absent from truth and prediction) and a summary."""
    width = max([len("class")] + [len(name) for name in classes])
    lines = [f"{'class':<{width}}  {'IoU':>7}  {'Acc':>7}", "-" * (width + 18)]
    for name, iou, acc in zip(classes, metrics["iou"], metrics["acc"]):
        def cell(value: float | None) -> str:
            return f"{100 * value:7.2f}" if value is not None else f"{'n/a':>7}"

        lines.append(f"{name:<{width}}  {cell(iou)}  {cell(acc)}")
    lines.append("-" * (width + 18))
    for label, key in (("mIoU", "miou"), ("pixel accuracy", "pixel_acc"), ("mean accuracy", "mean_acc"),
                       ("frequency-weighted IoU", "fwiou")):
        lines.append(f"{label:<22} {100 * metrics[key]:7.2f}")
    lines.append(f"{'images':<22} {metrics['num_images']:7d}")
    return "\n".join(lines)


def _prediction_saver(output_dir: Path, loader: Any, dataset: Any, config: Any):
    """on_batch callback writing DIR/color/<name>.png and DIR/labels/<name>.png for each prediction."""
    import numpy as np

    from syncseg.data import palette_image
    from syncseg.data.registry import dataset_kind
    from syncseg.engine.visualize import save_png
    from syncseg.lazy_registry import load_object

    color_dir, label_dir = output_dir / "color", output_dir / "labels"
    with writing("predictions under", output_dir):  # before the evaluation, not after it
        color_dir.mkdir(parents=True, exist_ok=True)
        label_dir.mkdir(parents=True, exist_ok=True)
    batches = list(loader.batch_sampler)  # the shard's indices, in the order the loader yields them
    kind = dataset_kind(config.data.dataset)
    palette = kind.palette_for(len(dataset.classes))
    # the benchmark servers' raw label values (Cityscapes labelIds, ADE20K 1..150); None: the class indices
    to_label_ids = load_object(kind.benchmark_labels) if kind.benchmark_labels else None

    def save_batch(batch_index: int, predictions: Any, masks: Any) -> None:
        for index, prediction in zip(batches[batch_index], predictions.numpy().astype(np.uint8)):
            name = dataset.name_of(index)
            with writing("predictions under", output_dir):
                save_png(palette_image(prediction, palette), color_dir / f"{name}.png")
                labels = to_label_ids[prediction] if to_label_ids is not None else prediction
                save_png(np.ascontiguousarray(labels, dtype=np.uint8), label_dir / f"{name}.png")

    return save_batch


def run(args: argparse.Namespace, dist_info: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Evaluate; returns (the JSON record written by rank 0 with --output, evaluate()'s metrics)."""
    from syncseg.data import build_dataset
    from syncseg.engine.devices import inference_device, log_precision
    from syncseg.engine.evaluate import evaluate
    from syncseg.engine.model_from_checkpoint import load_inference_model
    from syncseg.engine.object_store import local_data
    from syncseg.engine.samplers import build_eval_loader

    is_main = dist_info is None or dist_info.is_main
    torchrun_device = dist_info.device if dist_info is not None and dist_info.mode == "ddp" else None
    device = inference_device(args.device, torchrun_device=torchrun_device)
    loaded = load_inference_model(args.checkpoint, device=device, overrides=args.overrides, flags=_flags(args),
                                  runtime=runtime_choice(args))
    config, classes = loaded.config, loaded.classes
    split = args.split or config.data.val_split
    dataset = build_dataset(local_data(config.data), split, train=False, compact_masks=True)  # uint8 masks where they fit
    check_classes(args.checkpoint, classes, dataset, config.data, split)
    loader = build_eval_loader(dataset, batch_size=config.eval.batch_size, num_workers=config.data.num_workers,
                               pin_memory=device.type == "cuda")
    if args.output and is_main:  # a report that cannot be written fails before the evaluation, not after it
        with writing("report", args.output):
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    on_batch = None
    if args.save_predictions:
        on_batch = _prediction_saver(Path(args.save_predictions), loader, dataset, config)
    # what eval.amp (auto by default) runs as on this device: the report states that, not "auto"
    if loaded.runtime == "torch":
        eval_cfg = dataclasses.replace(config.eval, amp=log_precision("eval.amp", config.eval.amp, device))
        precision, exported = eval_cfg.amp, None
    else:  # the runtime's precision was logged when it was loaded
        eval_cfg = config.eval
        precision, exported = loaded.model.precision, str(loaded.model.path)
    if is_main:
        logger.info("evaluating %s (iteration %s) on %s/%s: %d images, mode=%s%s, scales=%s, flip=%s, amp=%s, "
                    "device %s", args.checkpoint, loaded.iteration, config.data.dataset, split, len(dataset),
                    eval_cfg.mode, f" window={'x'.join(map(str, eval_cfg.window_size))} stride={'x'.join(map(str, eval_cfg.stride))}"
                    if eval_cfg.mode == "slide" else "", ",".join(map(str, eval_cfg.scales)), eval_cfg.flip,
                    precision if exported is None else f"{precision} in {loaded.runtime}", device)
    metrics = evaluate(loaded.model, loader, num_classes=len(classes), device=device, data_cfg=config.data,
                       eval_cfg=eval_cfg, classes=classes, progress=is_main and not args.no_progress,
                       on_batch=on_batch)
    return _plain({
        "checkpoint": str(args.checkpoint),
        "iteration": loaded.iteration,
        "dataset": config.data.dataset,
        "split": split,
        "protocol": {
            "mode": eval_cfg.mode,
            "window_size": eval_cfg.window_size if eval_cfg.mode == "slide" else None,
            "stride": eval_cfg.stride if eval_cfg.mode == "slide" else None,
            "scales": list(eval_cfg.scales),
            "flip": eval_cfg.flip,
            "base_size": config.data.base_size,
            "amp": precision,
            "runtime": loaded.runtime,
            "exported": exported,
            "ignore_index": config.data.ignore_index,
        },
        "num_images": metrics["num_images"],
        "miou": metrics["miou"],
        "pixel_acc": metrics["pixel_acc"],
        "mean_acc": metrics["mean_acc"],
        "fwiou": metrics["fwiou"],
        "per_class": {name: {"iou": iou, "acc": acc}
                      for name, iou, acc in zip(classes, metrics["iou"], metrics["acc"])},
        "classes": classes,
        "iou": metrics["iou"],
        "acc": metrics["acc"],
        "num_pixels": metrics["num_pixels"],
        "device": str(device),
        "world_size": dist_info.world_size if dist_info is not None else 1,
    }), metrics


def print_config(args: argparse.Namespace) -> int:
    """--print-config: the checkpoint's config with the overrides and flags, read without its tensors
    (FileNotFoundError / ValueError when it cannot be read)."""
    from syncseg.engine.checkpoint_file import peek_checkpoint
    from syncseg.engine.config import config_yaml, inference_config
    from syncseg.engine.object_store import local_copy

    path = local_copy(args.checkpoint)  # once: for a URL each call asks the store
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{args.checkpoint}' not found (expected a .pt file written by "
                                "train.py)")
    saved = peek_checkpoint(path)
    if not saved or "config" not in saved:
        raise ValueError(f"checkpoint '{args.checkpoint}' could not be read (truncated, corrupt, or not a "
                         "syncseg checkpoint)")
    config = inference_config(saved["config"], args.overrides, source=f"checkpoint '{args.checkpoint}'",
                              flags=_flags(args))
    header = (f"eval.py config: checkpoint {args.checkpoint} (iteration {saved.get('iteration', '?')}) with the "
              "overrides and flags; every key")
    print(config_yaml(config, header=header), end="")
    return 0


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line flags that set eval.* keys (None: the checkpoint's value)."""
    return {"eval.mode": args.mode, "eval.scales": args.scales, "eval.flip": args.flip, "eval.amp": args.amp}


def main(argv: list[str] | None = None) -> int:
    """Evaluate as the command line says; returns the exit status (syncseg/engine/cli.py)."""
    args = parse_args(argv)
    return run_command("eval.py", lambda: _evaluate(args))


def _evaluate(args: argparse.Namespace) -> int:
    if args.print_config:
        return print_config(args)
    dist_info = None
    from syncseg.engine.distributed import detect_launch, setup_distributed

    launch = detect_launch()  # torchrun or srun: each process evaluates its own shard
    if launch.world_size > 1:
        dist_info = setup_distributed(None, launch=launch)
    is_main = dist_info is None or dist_info.is_main
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt=TIME_FORMAT)
    from syncseg.engine.allocator import keep_freed_memory

    logging.getLogger("eval").info(keep_freed_memory())
    failed = True
    try:
        record, metrics = run(args, dist_info)
        failed = False
    finally:
        if dist_info is not None:
            from syncseg.engine.distributed import cleanup

            cleanup(synchronize=not failed)  # after a failure a peer may never reach the barrier
    if is_main:
        print(format_table(record["classes"], metrics))
        if args.output:
            from syncseg.engine.atomic import write_atomically

            output, text = Path(args.output), (json.dumps(record, indent=2) + "\n").encode()
            with writing("report", output):  # atomically: an earlier report there stays whole if this one fails
                write_atomically(output, lambda file: file.write(text), what="report")
            logger.info("wrote %s", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
