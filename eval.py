"""Evaluate a checkpoint: mIoU, per-class IoU, pixel / mean accuracy, frequency-weighted IoU.

    python eval.py --checkpoint runs/voc/best.pt [--device cpu|cuda:0] [--split val] [--mode whole|slide]
                   [--scales 0.5,0.75,1.0,1.25,1.5,1.75] [--flip] [--save-predictions DIR]
                   [--output metrics.json] [KEY=VALUE ...]
    torchrun --nproc_per_node 4 eval.py --checkpoint ... (disjoint shards, one all-reduced matrix)

The model is rebuilt from the config stored in the checkpoint; KEY=VALUE overrides (e.g.
data.root=/data/VOCdevkit/VOC2012) and the flags above apply on top of it. Errors (missing files, a
checkpoint whose classes or architecture do not match the config) exit with status 2 and one line.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

logger = logging.getLogger("eval")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Evaluate a syncseg checkpoint on one device (or sharded under torchrun).",
        epilog="Example: python eval.py --checkpoint runs/voc/best.pt --mode slide --scales 0.75,1.0,1.25 --flip "
               "data.root=/data/VOCdevkit/VOC2012",
    )
    parser.add_argument("--checkpoint", required=True, help="a .pt file written by train.py (best.pt / last.pt)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available, else cpu; "
                                         "under torchrun each process uses cuda:LOCAL_RANK)")
    parser.add_argument("--split", help="dataset split to evaluate (default: the config's data.val_split)")
    parser.add_argument("--mode", choices=("whole", "slide"), help="whole image, or sliding windows of "
                                                                   "eval.crop_size every eval.stride pixels")
    parser.add_argument("--scales", help="comma-separated test scales, e.g. 0.5,0.75,1.0,1.25,1.5,1.75")
    parser.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                        help="also predict the horizontally flipped image and average the logits")
    parser.add_argument("--amp", choices=("off", "fp16", "bf16"),
                        help="autocast for inference (default: the checkpoint's train.amp, which training's "
                             "validation also uses, so both report the same numbers; 'off' for full precision)")
    parser.add_argument("--save-predictions", metavar="DIR",
                        help="write DIR/color/<name>.png (palette) and DIR/labels/<name>.png (class ids; "
                             "Cityscapes: labelIds for the benchmark server)")
    parser.add_argument("--output", metavar="JSON", help="write the metrics and the evaluation protocol here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides on top of the checkpoint's config, e.g. data.root=/data/VOC2012")
    return parser.parse_intermixed_args(argv)  # overrides may come before, between or after the options


def resolve_config(args: argparse.Namespace, payload: dict[str, Any]):
    """The checkpoint's config, then KEY=VALUE overrides, then the --mode/--scales/--flip flags."""
    from engine.config import inference_config

    return inference_config(payload["config"], args.overrides, source=f"checkpoint '{args.checkpoint}'",
                            mode=args.mode, scales=args.scales, flip=args.flip)


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


def _device(args: argparse.Namespace, dist_info: Any):
    import torch

    if dist_info is not None and dist_info.mode == "ddp":
        if args.device is not None:
            raise ValueError(f"--device {args.device} cannot be combined with torchrun: each process uses "
                             "cuda:LOCAL_RANK (or the CPU without CUDA)")
        return dist_info.device
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    return device


def run(args: argparse.Namespace, dist_info: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Evaluate; returns (the JSON record written by rank 0 with --output, evaluate()'s metrics)."""
    import numpy as np
    import torch

    from data import build_dataset, palette_image
    from engine.checkpoint import load_checkpoint, load_model_weights
    from engine.config import from_dict
    from engine.evaluate import build_eval_loader, evaluate
    from model.builder import build_model

    is_main = dist_info is None or dist_info.is_main
    device = _device(args, dist_info)
    payload = load_checkpoint(args.checkpoint)
    config = resolve_config(args, payload)
    if config.eval.mode == "slide" and config.eval.stride > config.eval.crop_size:
        raise ValueError(f"eval.stride={config.eval.stride} > eval.crop_size={config.eval.crop_size} would leave "
                         "pixels between the sliding windows uncovered; use a stride <= the crop size")
    saved_model_cfg = from_dict(payload["config"]).model
    split = args.split or config.data.val_split
    dataset = build_dataset(config.data, split, train=False)
    checkpoint_classes = [str(name) for name in payload["classes"]]
    check_classes(args.checkpoint, checkpoint_classes, dataset, config.data, split)
    num_classes = len(checkpoint_classes)
    model = build_model(config.model, num_classes)
    load_model_weights(model, payload["model"], checkpoint=args.checkpoint, saved_model_cfg=saved_model_cfg,
                       model_cfg=config.model)
    payload.pop("model")  # free host memory before the loop
    payload.pop("optimizer", None)
    model.to(device).eval()

    loader = build_eval_loader(dataset, batch_size=config.eval.batch_size, num_workers=config.data.num_workers,
                               pin_memory=device.type == "cuda")
    on_batch = None
    if args.save_predictions:
        output_dir = Path(args.save_predictions)
        color_dir, label_dir = output_dir / "color", output_dir / "labels"
        color_dir.mkdir(parents=True, exist_ok=True)
        label_dir.mkdir(parents=True, exist_ok=True)
        batches = list(loader.batch_sampler)  # the shard's indices, in the order the loader yields them
        palette = np.asarray(dataset.palette, dtype=np.uint8)
        to_label_ids = None
        if config.data.dataset == "cityscapes":
            from data.cityscapes import TRAINID_TO_LABELID

            to_label_ids = TRAINID_TO_LABELID
        from PIL import Image

        def save_batch(batch_index: int, predictions: torch.Tensor, masks: torch.Tensor) -> None:
            for index, prediction in zip(batches[batch_index], predictions.numpy().astype(np.uint8)):
                name = dataset.name_of(index)
                palette_image(prediction, palette).save(color_dir / f"{name}.png")
                labels = to_label_ids[prediction] if to_label_ids is not None else prediction
                Image.fromarray(np.ascontiguousarray(labels, dtype=np.uint8)).save(label_dir / f"{name}.png")

        on_batch = save_batch

    eval_cfg = config.eval
    amp = args.amp or config.train.amp
    if is_main:
        logger.info("evaluating %s (iteration %s) on %s/%s: %d images, mode=%s%s, scales=%s, flip=%s, device %s",
                    args.checkpoint, payload.get("iteration"), config.data.dataset, split, len(dataset), eval_cfg.mode,
                    f" crop={eval_cfg.crop_size} stride={eval_cfg.stride}" if eval_cfg.mode == "slide" else "",
                    ",".join(map(str, eval_cfg.scales)), eval_cfg.flip, device)
    metrics = evaluate(model, loader, num_classes=num_classes, device=device, mean=config.data.mean,
                       std=config.data.std, eval_cfg=eval_cfg, ignore_index=config.data.ignore_index,
                       classes=checkpoint_classes, progress=is_main and not args.no_progress, amp=amp,
                       on_batch=on_batch)
    return _plain({
        "checkpoint": str(args.checkpoint),
        "iteration": payload.get("iteration"),
        "dataset": config.data.dataset,
        "split": split,
        "protocol": {
            "mode": eval_cfg.mode,
            "crop_size": eval_cfg.crop_size if eval_cfg.mode == "slide" else None,
            "stride": eval_cfg.stride if eval_cfg.mode == "slide" else None,
            "scales": list(eval_cfg.scales),
            "flip": eval_cfg.flip,
            "base_size": config.data.base_size,
            "amp": amp,
        },
        "num_images": metrics["num_images"],
        "miou": metrics["miou"],
        "pixel_acc": metrics["pixel_acc"],
        "mean_acc": metrics["mean_acc"],
        "fwiou": metrics["fwiou"],
        "per_class": {name: {"iou": iou, "acc": acc}
                      for name, iou, acc in zip(checkpoint_classes, metrics["iou"], metrics["acc"])},
        "classes": checkpoint_classes,
        "iou": metrics["iou"],
        "acc": metrics["acc"],
        "num_pixels": metrics["num_pixels"],
        "device": str(device),
        "world_size": dist_info.world_size if dist_info is not None else 1,
    }), metrics


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist_info = None
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from engine.distributed import setup_distributed

            dist_info = setup_distributed(None)
    except ValueError as error:
        print(f"eval.py: error: {error}", file=sys.stderr)
        return 2
    is_main = dist_info is None or dist_info.is_main
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    failed = True
    try:
        record, metrics = run(args, dist_info)
        failed = False
    except (ValueError, FileNotFoundError) as error:
        print(f"eval.py: error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist_info is not None:
            from engine.distributed import cleanup

            cleanup(synchronize=not failed)  # after a failure a peer may never reach the barrier
    if is_main:
        print(format_table(record["classes"], metrics))
        if args.output:
            output = Path(args.output)
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(json.dumps(record, indent=2) + "\n")
            logger.info("wrote %s", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
