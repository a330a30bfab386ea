"""Export a checkpoint (best.pt or last.pt) for deployment, and check the file against PyTorch.

    python -m syncseg export --checkpoint runs/demo/best.pt --format onnx
    python -m syncseg export --checkpoint runs/voc/best.pt --format exported --size 513,513 --output voc.pt2
    python -m syncseg export --checkpoint runs/voc/best.pt --format safetensors   (weights for a release)

The model takes normalized float32 images N x C x H x W (C = the checkpoint's data.in_channels; x /
data.max_value, then (x - mean) / std with its data.mean / data.std; the file's metadata repeats them
and the class names) and returns
the logits N x C x H x W. Batch, height and width are dynamic. After writing, the file is run on a
random sample of --size and on a second size, and compared with PyTorch (ONNX through onnxruntime when
it is installed).

--format decides the file's format. A safetensors file must be named *.safetensors (eval.py, predict.py
and model.init_checkpoint know it by that suffix) and no other format may use that suffix: a name that
breaks this is refused before anything is written.

Exit status and error lines: syncseg/engine/cli.py (0 written and matching, or not checkable, with a
message; 1 the file does not match PyTorch (a safetensors file that does not read back identical is
removed), or it could not be written (named); 2 a bad command line, --output name or checkpoint).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from syncseg.engine.registry import EXPORT_FORMATS  # plain Python

# torch and the engine are imported after the arguments are parsed, so that --help answers at once.

logger = logging.getLogger("export")



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Export a syncseg checkpoint to ONNX, TorchScript, torch.export or safetensors, checked "
                    "against PyTorch.",
        epilog="Example: python -m syncseg export --checkpoint runs/demo/best.pt --format onnx --size 96,96")
    parser.add_argument("--checkpoint", required=True, help="a .pt file written by train.py (best.pt or last.pt)")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS.names(),
                        help="; ".join(f"{name} ({entry.description})" for name, entry in EXPORT_FORMATS.items()))
    parser.add_argument("--size", metavar="H,W",
                        help="height,width of the sample the model is exported and checked with (default: the "
                             "checkpoint's data.crop_size); the file accepts other sizes too")
    parser.add_argument("--output", metavar="PATH",
                        help="where to write (default: beside the checkpoint, e.g. best.onnx, best.torchscript.pt, "
                             "best.pt2, best.safetensors)")
    qgis = parser.add_argument_group("QGIS Deepness plugin (with --format onnx)")
    qgis.add_argument("--deepness", action="store_true",
                      help="write an ONNX file the QGIS Deepness plugin runs (<name>.deepness.onnx): square tiles "
                           "of --size (default data.crop_size), the raster's values / 255 in, class probabilities "
                           "out, its metadata (class names, tile size, overlap, resolution)")
    qgis.add_argument("--tiles-overlap", type=int, metavar="PERCENT",
                      help="with --deepness: the overlap of the plugin's tiles, percent of the tile (default 15)")
    qgis.add_argument("--resolution", type=float, metavar="CM",
                      help="with --deepness: the ground resolution the model was trained at, centimetres per pixel "
                           "(the plugin resamples the map to it; default: not set, the user picks it)")
    qgis.add_argument("--seg-threshold", type=float, metavar="P",
                      help="with --deepness: the plugin's class confidence threshold (default: not set)")
    int8 = parser.add_argument_group("int8 (with --format onnx)")
    int8.add_argument("--int8", action="store_true",
                      help="also write an int8 quantization of the ONNX file (<name>.int8.onnx), calibrated on "
                           "--calibrate training images, and report its validation mIoU beside the fp32 file's")
    int8.add_argument("--calibrate", type=int, default=32, metavar="N",
                      help="training images to calibrate the int8 ranges on (default 32)")
    int8.add_argument("--calibration-method", default="percentile", choices=("percentile", "minmax", "entropy"),
                      help="how the ranges are chosen from the calibration (default percentile)")
    int8.add_argument("--max-miou-drop", type=float, default=1.0, metavar="POINTS",
                      help="the int8 file may lose at most this many mIoU points against fp32 (default 1.0)")
    int8.add_argument("--on-drop", choices=("refuse", "warn"), default="refuse",
                      help="past --max-miou-drop: refuse (remove the int8 file, exit 1; the default) or warn")
    return parser


def parse_size(text: str | None, default: tuple[int, int]) -> tuple[int, int]:
    """'H,W' (or one number for a square) -> (H, W), each at least 32; `default` (data.crop_size, H,W)
    when `text` is None; ValueError otherwise."""
    if text is None:
        return max(32, default[0]), max(32, default[1])
    try:
        values = [int(part) for part in text.replace("x", ",").split(",") if part.strip()]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or min(values) < 32:
        raise ValueError(f"--size {text!r}: expected HEIGHT,WIDTH in pixels, each at least 32 (e.g. 513,513)")
    return values[0], values[1]


def check_output_name(fmt: str, output: Path) -> None:
    """ValueError when `output`'s name would make the file misread: the loaders (eval.py, predict.py,
    model.init_checkpoint) take a file for safetensors by its suffix and for a torch.save file otherwise
    (syncseg.engine.checkpoint_file.is_safetensors_name), and torch.export files need '.pt2'."""
    from syncseg.engine.checkpoint_file import SAFETENSORS_SUFFIX, is_safetensors_name
    from syncseg.engine.export_formats import SUFFIXES

    if fmt == "safetensors" and not is_safetensors_name(output):
        raise ValueError(
            f"--format safetensors: --output '{output}' ends in '{output.suffix}', not '{SAFETENSORS_SUFFIX}'; "
            "eval.py, predict.py and model.init_checkpoint tell a safetensors file by that suffix and would not "
            f"read this one: use a {SAFETENSORS_SUFFIX} name, e.g. '{output.with_suffix(SAFETENSORS_SUFFIX)}'")
    if fmt == "exported" and output.suffix != SUFFIXES[fmt]:
        # torch.export.save warns and writes anyway, and torch.export.load then expects the suffix
        raise ValueError(f"--format exported: --output '{output}' ends in '{output.suffix}', but torch.export "
                         f"files must end in '{SUFFIXES[fmt]}': use e.g. '{output.with_suffix(SUFFIXES[fmt])}'")
    if fmt != "safetensors" and is_safetensors_name(output):
        raise ValueError(
            f"--format {fmt}: --output '{output}' ends in '{SAFETENSORS_SUFFIX}', which eval.py, predict.py and "
            f"model.init_checkpoint read as safetensors weights: use another name, e.g. "
            f"'{output.with_suffix(SUFFIXES[fmt])}'")


def _read_back_problem(path: Path, state: dict) -> str | None:
    """None when the safetensors file at `path` loads as a checkpoint holding exactly `state`'s tensors,
    else what is wrong with it."""
    import torch

    from syncseg.engine.checkpoint_file import load_checkpoint

    try:
        reread = load_checkpoint(path)["model"]
    except ValueError as error:
        return f"does not read back: {error}"
    if reread.keys() != state.keys() or not all(torch.equal(reread[key], value) for key, value in state.items()):
        return "does not hold the checkpoint's tensors"
    return None


def run(args: argparse.Namespace) -> int:
    """Export and check as `args` say; returns 0, or raises (syncseg/engine/cli.py maps the exception)."""
    import torch

    from syncseg.engine.checkpoint_file import load_checkpoint, save_safetensors
    from syncseg.engine.cli import CommandFailed, writing
    from syncseg.engine.export_formats import SUFFIXES, export_metadata, export_model, export_ready, sample_inputs
    from syncseg.engine.model_from_checkpoint import load_inference_model
    from syncseg.engine.runtimes import file_digest

    if args.size is not None:
        parse_size(args.size, (0, 0))  # a bad --size fails before the model is loaded
    if args.int8 and args.format != "onnx":
        raise ValueError(f"--int8 quantizes an ONNX file: use it with --format onnx, not --format {args.format}")
    if args.deepness and (args.format != "onnx" or args.int8):
        raise ValueError("--deepness writes an fp32 ONNX file: use it with --format onnx and without --int8")
    stray = [flag for flag, value in (("--tiles-overlap", args.tiles_overlap), ("--resolution", args.resolution),
                                      ("--seg-threshold", args.seg_threshold)) if value is not None]
    if stray and not args.deepness:
        raise ValueError(f"{', '.join(stray)} set the QGIS Deepness plugin's metadata: add --deepness")
    if args.int8:
        from syncseg.engine.runtimes import require_runtime

        require_runtime("onnxruntime")  # quantizes and evaluates the int8 file
    checkpoint = Path(args.checkpoint)
    suffix = ".deepness.onnx" if args.deepness else SUFFIXES[args.format]
    output = Path(args.output) if args.output else checkpoint.with_name(checkpoint.stem + suffix)
    if output.resolve() == checkpoint.resolve():
        raise ValueError(f"--output '{output}' is the checkpoint itself; choose another path")
    check_output_name(args.format, output)  # before anything is read or written
    # an unwritable folder fails now, not after the export; worded as syncseg.engine.atomic words a failed write
    with writing("safetensors file" if args.format == "safetensors" else "export", output):
        output.parent.mkdir(parents=True, exist_ok=True)
    if args.format == "safetensors":
        payload = load_checkpoint(checkpoint)
        with writing("safetensors file", output):
            save_safetensors(output, payload)
        problem = _read_back_problem(output, payload["model"])
        if problem is not None:  # a file the loaders would reject is not left behind
            output.unlink(missing_ok=True)
            raise CommandFailed(f"'{output}' {problem}; removed it")
        logger.info("wrote %s (%.1f MB): %d tensors, the config and classes as metadata; reads back identical",
                    output, output.stat().st_size / 2**20, len(payload["model"]))
        return 0
    loaded = load_inference_model(checkpoint, device=torch.device("cpu"), overrides=["model.channels_last=false"])
    calibration = None
    if args.int8:  # a calibration split smaller than --calibrate fails before anything is written
        from syncseg.engine.int8 import calibration_inputs

        calibration = calibration_inputs(loaded.config, len(loaded.classes), args.calibrate)
    module = export_ready(loaded.model)
    metadata = export_metadata(classes=loaded.classes, config=loaded.config, checkpoint=checkpoint,
                               iteration=loaded.iteration, checkpoint_sha256=file_digest(checkpoint))
    if args.deepness:
        return write_deepness(args, loaded, module, metadata, output)
    height, width = parse_size(args.size, loaded.config.data.crop_size)
    inputs = sample_inputs(height, width, channels=loaded.config.data.in_channels)
    with writing("export", output):
        dynamic = export_model(module, args.format, output, sample=inputs[0], metadata=metadata)
    logger.info("wrote %s (%s, %d classes; %s)", output, args.format, len(loaded.classes), dynamic)
    if not check_written(args.format, module, output, inputs):
        return 0
    if calibration is not None:
        return write_int8(args, loaded, output, calibration)
    return 0


def check_written(fmt: str, module: Any, output: Path, inputs: list, *, compared: str = "") -> bool:
    """Run the written file on `inputs` beside `module`: True when it matches, False (with a warning) when its
    runtime is not installed; CommandFailed when it differs."""
    from syncseg.engine.cli import CommandFailed
    from syncseg.engine.export_formats import MissingRuntimeError, check_against_pytorch, load_runner

    try:
        runner = load_runner(fmt, output)
    except MissingRuntimeError as missing:
        logger.warning("%s", missing)
        return False
    result = check_against_pytorch(module, runner, inputs)
    if not result.passed:
        raise CommandFailed(f"'{output}' does not match PyTorch: {result.describe()}")
    logger.info("checked against PyTorch%s: %s", f" ({compared})" if compared else "", result.describe())
    return True


def write_deepness(args: argparse.Namespace, loaded: Any, module: Any, metadata: dict, output: Path) -> int:
    """The QGIS Deepness plugin's file (syncseg.engine.deepness), checked in onnxruntime against PyTorch;
    `metadata` is export_metadata's, the plugin's keys go on top."""
    import torch

    from syncseg.engine.cli import writing
    from syncseg.engine.deepness import DEFAULT_OVERLAP, DeepnessModel, check_options, deepness_metadata, merged
    from syncseg.engine.export_formats import export_model

    data = loaded.config.data
    overlap = DEFAULT_OVERLAP if args.tiles_overlap is None else args.tiles_overlap
    tile = check_options(parse_size(args.size, data.crop_size), overlap, args.resolution, args.seg_threshold)
    model = DeepnessModel(module, max_value=data.max_value, mean=data.mean, std=data.std).eval()
    generator = torch.Generator().manual_seed(0)
    top = data.max_value / 255.0  # the plugin's input: the raster's values / 255
    sample, check = (torch.rand(1, data.in_channels, tile, tile, generator=generator) * top for _ in range(2))
    metadata = merged(metadata, deepness_metadata(classes=loaded.classes, tile=tile, overlap=overlap,
                                                  resolution=args.resolution, threshold=args.seg_threshold))
    with writing("export", output):
        export_model(model, "onnx", output, sample=sample, metadata=metadata, dynamic=False)
    logger.info("wrote %s (QGIS Deepness: tiles %dx%d, overlap %d%%, %d classes%s)", output, tile, tile,
                overlap, len(loaded.classes),
                f", {args.resolution:g} cm/px" if args.resolution is not None else ", resolution not set")
    check_written("onnx", model, output, [check], compared="probabilities")
    return 0


def int8_name(output: Path) -> Path:
    """best.onnx -> best.int8.onnx."""
    return output.with_name(f"{output.stem}.int8{output.suffix or '.onnx'}")


def write_int8(args: argparse.Namespace, loaded: object, output: Path, inputs: list) -> int:
    """Quantize `output` (the checked fp32 ONNX file) to int8 on the calibration `inputs` and compare both
    files on the validation split."""
    from syncseg.engine.cli import CommandFailed, writing
    from syncseg.engine.int8 import compare_miou, quantize_onnx

    target = int8_name(output)
    with writing("int8 export", target):
        quantize_onnx(output, target, inputs, method=args.calibration_method)
    logger.info("wrote %s (%.1f MB, int8 QDQ; %s calibration on %d inputs of %d training images)", target,
                target.stat().st_size / 2**20, args.calibration_method, len(inputs), args.calibrate)
    comparison = compare_miou(loaded.config, loaded.classes, output, target)
    if comparison.drop_points > args.max_miou_drop:
        problem = f"int8 loses more than --max-miou-drop {args.max_miou_drop:g}: {comparison.describe()}"
        if args.on_drop == "refuse":
            target.unlink(missing_ok=True)
            raise CommandFailed(f"{problem}; removed '{target}' (more --calibrate images, another "
                                f"--calibration-method, or --on-drop warn to keep it)")
        logger.warning("%s; kept '%s' (--on-drop warn)", problem, target)
        return 0
    logger.info("%s", comparison.describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Export as the command line says; returns the exit status (syncseg/engine/cli.py)."""
    from syncseg.engine.cli import TIME_FORMAT, run_command

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt=TIME_FORMAT)
    for chatty in ("onnx_ir", "onnxscript", "torch.onnx", "torch.export", "torch._export"):  # per-pass notes
        logging.getLogger(chatty).setLevel(logging.WARNING)
    return run_command("syncseg-export", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
