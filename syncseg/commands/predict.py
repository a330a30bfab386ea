"""Run a trained checkpoint on your own images: color masks and overlays, any image size.

    python -m syncseg predict --checkpoint runs/voc/best.pt --input photo.jpg --output out/ --legend
    python -m syncseg predict --checkpoint runs/cityscapes/best.pt --input frames/ --output out/ --mode slide

For each image <name> it writes <output>/<name>_mask.png (palette PNG: pixel value = class index, colored with
the dataset palette) and <output>/<name>_overlay.png (the photo with the color of each class blended in at
--alpha; pixels of the class named "background" keep the photo's own colors); --legend also writes
<output>/legend.png (color and name of each class); --format coco,labelme,cvat,yolo_seg also writes the
masks as pre-annotations the labelling tool imports, under <output>/<format>/ (syncseg.engine.tool_formats).
With a folder, images are found recursively and the subfolders are kept. Photos are turned upright by their EXIF orientation (as viewers show them; the masks
match the upright image). Images are read in the checkpoint's format (data.in_channels, data.max_value:
16-bit, 1- or N-channel PNG and TIFF as stored; an image of another channel count or bit depth is skipped,
naming both); the overlay of such an image is drawn on its first channel (grey) or first three, scaled to 8
bits. The image is predicted by syncseg.api.Predictor (engine.inference.predict_batch), as validation and eval.py predict
(normalization, the checkpoint's eval.mode/scales/flip and eval.amp unless flags say otherwise); masks are at
the original resolution (data.base_size > 0 predicts at that long side, then resizes the logits back). An
image whose long side is more than LARGE_IMAGE_FACTOR times the training crop gets a warning: objects in it
are likely much larger than the model ever saw, so set data.base_size (or use --mode slide for a model trained
on crops of such images).

An image of a folder that cannot be read is skipped with a warning naming it and the reason; the
others are predicted, and the last line says how many (and which) failed. Exit status and error
lines: syncseg/engine/cli.py (0 every image written; 1 some image of a folder could not be read, or an output
could not be written (named); 2 a bad command line, checkpoint or --input, a single unreadable
--input file included).
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The engine is imported after the arguments are parsed, so that --help answers at once.

logger = logging.getLogger("predict")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
LARGE_IMAGE_FACTOR = 2  # warn when the long side predicted at exceeds this many training crops
NAMED_FAILURES = 3  # the summary names this many of the images that could not be read
DEFAULT_TILE = 512  # scene mode's tile
RASTER_EXTENSIONS = (".tif", ".tiff", ".vrt", ".img", ".jp2")


@dataclass
class Outcome:
    """What run() did: the images written and those skipped because they could not be read."""

    num_images: int
    skipped: list[Path] = field(default_factory=list)
    written: str = "masks and overlays"  # what was written for each image

    @property
    def num_written(self) -> int:
        return self.num_images - len(self.skipped)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Predict segmentation masks for images with a trained checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="best.pt or last.pt written by train.py (or a "
                                                            ".safetensors file from `python -m syncseg export`)")
    parser.add_argument("--input", required=True, help="an image file or a folder of images (searched recursively)")
    parser.add_argument("--output", required=True, help="folder for <name>_mask.png and <name>_overlay.png")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--mode", help="whole or slide (default: the checkpoint's eval.mode)")
    parser.add_argument("--scales", help="comma-separated test scales (default: the checkpoint's eval.scales)")
    parser.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                        help="also predict the mirrored image and average (default: the checkpoint's eval.flip)")
    parser.add_argument("--amp", help="precision: auto, off, tf32, fp16 or bf16 (default: the checkpoint's eval.amp)")
    from syncseg.engine.cli import add_runtime_arguments  # the standard library only

    add_runtime_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=1, metavar="N",
                        help="predict up to N consecutive images of one size together (default 1; more helps on a "
                             "GPU and costs memory; slide windows are batched by eval.window_batch either way)")
    parser.add_argument("--alpha", type=float, default=0.5,
                        help="overlay opacity of the class colors, 0..1 (background pixels stay untouched)")
    parser.add_argument("--legend", action="store_true", help="also write <output>/legend.png: each class color "
                                                              "and name")
    parser.add_argument("--format", default="", metavar="NAMES",
                        help="also write the masks as pre-annotations a labelling tool imports: coco, labelme, cvat, "
                             "yolo_seg (comma-separated), under <output>/<format>/ (docs/own-data.md)")
    scenes = parser.add_argument_group("whole georeferenced scenes (GeoTIFF in, GeoTIFF out; the geo extra)")
    scenes.add_argument("--tile", type=int, metavar="PIXELS",
                        help="predict --input rasters as scenes, in tiles of this many pixels a side (default for a "
                             "checkpoint trained on data.dataset=raster: %d, or a smaller scene's short side); writes "
                             "<name>_classes.tif with the "
                             "input's CRS, transform and nodata" % DEFAULT_TILE)
    scenes.add_argument("--overlap", type=int, metavar="PIXELS",
                        help="pixels that neighbouring tiles share, blended by edge weights (default: --tile / 8)")
    scenes.add_argument("--probabilities", action="store_true",
                        help="also write <name>_probabilities.tif: one band per class, in percent")
    scenes.add_argument("--vectors", action="store_true",
                        help="also write <name>_classes.geojson: the polygons of each class (EPSG:4326)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. eval.window_size=769 eval.stride=512 data.base_size=1024")
    return parser.parse_intermixed_args(argv)


def find_images(path: Path) -> list[tuple[Path, Path]]:
    """(image file, output stem relative to the output folder) for a file or a folder (recursive)."""
    if path.is_file():
        return [(path, Path(path.stem))]
    if not path.is_dir():
        raise FileNotFoundError(f"--input '{path}' is neither an image file nor a folder")
    images = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not images:
        raise FileNotFoundError(f"--input '{path}' holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return [(image, image.relative_to(path).with_suffix("")) for image in images]


def main(argv: list[str] | None = None) -> int:
    """Predict as the command line says; returns the exit status (syncseg/engine/cli.py)."""
    from syncseg.engine.cli import TIME_FORMAT, CommandFailed, run_command

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt=TIME_FORMAT)
    from syncseg.engine.allocator import keep_freed_memory

    logger.info(keep_freed_memory())

    def body() -> int:
        outcome = run(args)
        if outcome.skipped:
            names = ", ".join(str(path) for path in outcome.skipped[:NAMED_FAILURES])
            more = len(outcome.skipped) - NAMED_FAILURES
            raise CommandFailed(
                f"{len(outcome.skipped)} of {outcome.num_images} image(s) could not be read and were skipped "
                f"({names}{f' and {more} more' if more > 0 else ''}; the warnings above say why); wrote masks "
                f"and overlays for the other {outcome.num_written} to {args.output}")
        logger.info("wrote %s for %d image(s) to %s", outcome.written, outcome.num_written, args.output)
        return 0

    return run_command("syncseg-predict", body)


def run(args: argparse.Namespace) -> Outcome:
    """Predict every image of --input. An unreadable image of a folder is skipped with a warning (and
    counted in the Outcome); a single unreadable --input file is a ValueError, like the other errors
    of the command line. An output that cannot be written is an OSError naming it (nothing is skipped:
    the next image would meet the same full disk)."""
    import numpy as np

    from syncseg.data import BadSampleError, palette_image
    from syncseg.data.registry import dataset_kind
    from syncseg.data.images import ImageFormat, display_rgb, read_image
    from syncseg.engine.cli import runtime_choice, writing
    from syncseg.engine.devices import inference_device
    from syncseg.engine.devices import log_precision
    from syncseg.api import Predictor
    from syncseg.engine.model_from_checkpoint import load_inference_model
    from syncseg.engine.visualize import background_indices, legend_image, overlay, save_png

    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"--alpha {args.alpha} must lie in [0, 1]")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be at least 1")
    from syncseg.engine.tool_formats import PredictedImage, parse_formats, write_tool_formats

    formats = parse_formats(args.format)
    images = find_images(Path(args.input))
    single_file = Path(args.input).is_file()
    output = Path(args.output)
    with writing("masks and overlays under", output):  # before the model is loaded, not after the first image
        output.mkdir(parents=True, exist_ok=True)
    choice = runtime_choice(args)  # a bad --exported/--threads before the model is loaded
    device = inference_device(args.device)
    loaded = load_inference_model(args.checkpoint, device=device, overrides=args.overrides,
                                  flags={"eval.mode": args.mode, "eval.scales": args.scales, "eval.flip": args.flip,
                                         "eval.amp": args.amp}, runtime=choice)
    config, classes = loaded.config, loaded.classes
    predictor = Predictor.from_loaded(loaded)
    if args.tile is not None or config.data.dataset == "raster":
        return run_scenes(args, predictor, output)
    # the kind's colours, without opening the dataset (its files may not exist here)
    palette = dataset_kind(config.data.dataset).palette_for(len(classes))
    base_size = config.data.base_size
    if loaded.runtime == "torch":  # a runtime's precision was logged when it was loaded
        log_precision("eval.amp", config.eval.amp, device)  # what the Predictor runs, in the log
    uncoloured = background_indices(classes)
    image_format = ImageFormat.of(config.data)  # the checkpoint's data.in_channels and data.max_value
    outcome = Outcome(num_images=len(images))
    large = []
    pending: list[tuple[Path, Path, np.ndarray]] = []  # read, not yet predicted: consecutive images of one size
    predicted: list[PredictedImage] = []  # for --format: the masks written, read back by the writers

    def flush() -> None:
        masks = predictor.predict_many([image for _, _, image in pending], batch_size=len(pending)) if pending else []
        for (image_path, stem, image), mask in zip(pending, masks):
            labels = mask.astype(np.uint8)  # the API's path: the same normalization and eval settings
            target = output / stem  # save_png creates the folders
            with writing("masks and overlays under", output):
                save_png(palette_image(labels, palette), target.with_name(f"{target.name}_mask.png"))
                predicted.append(PredictedImage(file_name=(stem.parent / image_path.name).as_posix(),
                                                mask=target.with_name(f"{target.name}_mask.png"), image=image_path))
                save_png(overlay(display_rgb(image, image_format.max_value), labels, palette, alpha=args.alpha,
                                 uncoloured=uncoloured),
                         target.with_name(f"{target.name}_overlay.png"))
            height, width = image.shape[:2]
            present = ", ".join(classes[index] for index in np.unique(labels))
            logger.info("%s (%dx%d): %s", image_path, width, height, present)
        pending.clear()

    for image_path, stem in images:
        try:  # H x W x 3 uint8 RGB upright as viewers show it, or the checkpoint's channels and bit depth
            image = read_image(image_path, image_format, exif_orientation=True)
        except BadSampleError as error:  # names the file and the reason
            if single_file:
                raise
            logger.warning("skipping %s: %s", image_path, error)
            outcome.skipped.append(image_path)
            continue
        height, width = image.shape[:2]
        crop = config.data.crop_size  # (height, width)
        if too_large(max(height, width), base_size=base_size, crop_size=max(crop), mode=config.eval.mode):
            if not large:
                crop_text = str(crop[0]) if crop[0] == crop[1] else f"{crop[0]},{crop[1]}"
                logger.warning("%s is %dx%d, more than %d times the training crop (data.crop_size=%s): objects in it "
                               "are probably far larger than the model saw in training, and it may mislabel them. "
                               "Set data.base_size=%d to predict at a long side of that size (or use --mode slide "
                               "with eval.window_size=%s if the model was trained on crops of images this large)",
                               image_path, width, height, LARGE_IMAGE_FACTOR, crop_text, max(crop), crop_text)
            large.append(image_path)
        if pending and pending[0][2].shape != image.shape:
            flush()
        pending.append((image_path, stem, image))
        if len(pending) >= args.batch_size:
            flush()
    flush()
    if len(large) > 1:
        logger.warning("%d of %d images were that large (see the warning above)", len(large), len(images))
    if formats and predicted:
        with writing("the pre-annotations under", output):
            written = write_tool_formats(formats, predicted, classes=classes, label_ids=loaded.label_ids,
                                         output=output, ignore_index=config.data.ignore_index)
        logger.info("wrote %s for %d image(s): %s", ", ".join(formats), len(predicted),
                    ", ".join(str(path) for path in written[:4]) + (" ..." if len(written) > 4 else ""))
    if args.legend:
        with writing("the legend under", output):
            save_png(legend_image(classes, palette, width=max(240, 120 * min(len(classes), 4))),
                     output / "legend.png")
    return outcome


def run_scenes(args: argparse.Namespace, predictor: Any, output: Path) -> Outcome:
    """Predict every raster of --input as a whole scene (syncseg.engine.scene_predict): tiles, blended, GeoTIFF out."""
    import dataclasses

    from syncseg.data.raster.scenes import SceneReader, check_scene_format, read_scene
    from syncseg.engine.cli import writing
    from syncseg.engine.scene_predict import check_tiling, predict_scene

    config = predictor.config
    unused = [flag for flag, value in (("--format", args.format), ("--legend", args.legend)) if value]
    if unused:
        logger.warning("%s: not for scenes, which are written as GeoTIFF (--probabilities and --vectors add to it)",
                       " and ".join(unused))
    if args.mode is None and config.eval.mode != "whole":  # the tiles are the windows
        predictor = dataclasses.replace(predictor, config=dataclasses.replace(
            config, eval=dataclasses.replace(config.eval, mode="whole")))
    path = Path(args.input)
    rasters = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in RASTER_EXTENSIONS) if path.is_dir() else []
    if not rasters:
        raise FileNotFoundError(f"--input '{path}' is neither a raster file nor a folder holding rasters "
                                f"({', '.join(RASTER_EXTENSIONS)})")
    readers = []
    for raster in rasters:  # every header first: a bad one is named before any scene is predicted
        scene = read_scene(raster)
        check_scene_format(scene, channels=config.data.in_channels, max_value=config.data.max_value,
                           raster_scale=config.data.raster_scale)
        # without --tile, a scene smaller than the default tile is one tile
        tile = min(DEFAULT_TILE, scene.width, scene.height) if args.tile is None else args.tile
        overlap = tile // 8 if args.overlap is None else args.overlap
        check_tiling(scene, tile, overlap)
        readers.append((SceneReader(scene, max_value=config.data.max_value, raster_scale=config.data.raster_scale),
                        tile, overlap))
    for reader, tile, overlap in readers:
        scene = reader.scene
        with writing("the scene's prediction under", output):
            result = predict_scene(reader, predictor.predict_logits_batch, num_classes=len(predictor.classes),
                                   class_names=predictor.classes, output=output, tile=tile, overlap=overlap,
                                   batch_size=args.batch_size, probabilities=args.probabilities,
                                   vectors=args.vectors)
        megapixels = scene.width * scene.height / 1e6
        shares = ", ".join(f"{name} {count / max(1, result.counts.sum()):.1%}"
                           for name, count in zip(predictor.classes, result.counts) if count)
        logger.info("%s (%dx%d, %s): %d tiles of %d px (overlap %d) in %.1f s, %.2f megapixels/s; %s; wrote %s",
                    scene.path, scene.width, scene.height, scene.describe_crs(), result.tiles, tile, overlap,
                    result.seconds, megapixels / max(result.seconds, 1e-9), shares or "no valid pixel",
                    ", ".join(str(p) for p in result.written()))
    return Outcome(num_images=len(readers), written="the classes' GeoTIFF (and what the flags ask)")


def too_large(long_side: int, *, base_size: int, crop_size: int, mode: str) -> bool:
    """Whether an image is predicted at a scale far beyond training's: in whole-image mode, its long
    side (data.base_size when that resizes it) over LARGE_IMAGE_FACTOR times the crop's long side."""
    predicted = base_size if base_size > 0 else long_side
    return mode == "whole" and predicted > LARGE_IMAGE_FACTOR * crop_size


if __name__ == "__main__":
    sys.exit(main())
