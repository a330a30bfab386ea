"""Few images, sparse labels: a scene of real textures with polygon labels on ~2% of the pixels, a per-pixel
baseline, and the configs trained on it (issue 32 item 2).

The data (`build_scene`): a 384 x 384 scene of five land covers (COVERS) made of three real CC0 textures
from benchmarks/textures/ (brick, grass, gravel; README.md there), laid out as irregular regions (Voronoi
cells whose borders are bent by a smooth random field), lit by a gentle gradient, tinted a little per class
in its 3 bands (so the band values carry some of the class, as spectra do), with sensor noise. It is cut
into 36 tiles of 64 x 64 (8-bit RGB PNGs): the 24 tiles of the left two thirds train, with small polygons
drawn inside the regions (about 2% of their pixels labelled, 255 elsewhere), the 12 tiles of the right
third validate, every pixel labelled: held-out regions, where each cover shows a part of its texture that
its training pixels do not.

The baseline (`nearest_centroid`): each class's mean band values over the labelled training pixels; every
validation pixel takes the class of the nearest mean. Its val mIoU is the figure a recipe must beat.

    python -m benchmarks.small_data --root /tmp/sparse                       # data and baseline
    python -m benchmarks.small_data --root /tmp/sparse --train small_data.yaml demo.yaml train.iters=300
    python -m benchmarks.small_data --root /tmp/sparse --format yolo_seg --train small_data.yaml data.uncovered=ignore

`--train` runs train.py on the data for each config named, with the lines verify_dataset prints for it and
any KEY=VALUE after them, and prints each run's best val mIoU beside the baseline's. `--format coco|yolo_seg|...`
writes the same labels as that annotation tool's export instead of a folder (syncseg.data.annotations.writers:
the sparse polygons of the training tiles, the dense ones of the validation tiles; unlabelled pixels are no
shape), read by that data set kind: with data.uncovered=ignore the masks are the folder's, with
data.uncovered=background every pixel nobody drew trains as a background class, as a trainer that fills
uncovered pixels with background (Ultralytics' semantic task) does.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

TEXTURES = Path(__file__).resolve().parent / "textures"
# land covers: (name, texture, gain of each band R, G, B). Two pairs share a texture and differ in their bands
# only, as crops or soils of one grain do in spectra; the gains are faint enough that the band values alone
# leave about half the pixels wrong, as on the Landsat tiles (its baseline: pixel accuracy 0.50)
COVERS = (("built-up", "brick", (1.15, 0.95, 0.875)), ("grass", "grass", (0.9, 1.125, 0.9)),
          ("dry grass", "grass", (1.125, 1.05, 0.75)), ("gravel", "gravel", (1.0, 1.0, 1.05)),
          ("wet gravel", "gravel", (0.75, 0.8, 0.925)))
CLASSES = tuple(name for name, _, _ in COVERS)
SCENE, TILE = 384, 64
TRAIN_COLUMNS = 256  # the scene's left 256 columns train, the right 128 validate
IGNORE = 255
NOISE = 6.0  # sensor noise, grey levels (1 sigma)
LABELLED_FRACTION = 0.02


@dataclass(frozen=True)
class Scene:
    """The generated scene: image (SCENE x SCENE x 3 uint8), classes (SCENE x SCENE, every pixel) and the sparse
    training labels (the same size, IGNORE where unlabelled and in the validation columns)."""

    image: np.ndarray
    classes: np.ndarray
    sparse: np.ndarray


def _texture(name: str) -> np.ndarray:
    from PIL import Image

    with Image.open(TEXTURES / f"{name}.png") as file:
        return np.asarray(file.convert("L"), dtype=np.float64)


def _regions(rng: np.random.Generator, *, num_cells: int = 40, wobble: float = 10.0) -> np.ndarray:
    """SCENE x SCENE class indices: Voronoi cells of random seeds, borders bent by a smooth random field, each
    cell a random class; every class appears on both sides of the train / val border."""
    from scipy.ndimage import gaussian_filter

    while True:
        seeds = rng.uniform(0, SCENE, (num_cells, 2))
        cell_class = rng.integers(0, len(CLASSES), num_cells)
        rows, cols = np.mgrid[0:SCENE, 0:SCENE].astype(np.float64)
        bend = [gaussian_filter(rng.normal(size=(SCENE, SCENE)), 16.0) for _ in range(2)]
        rows = rows + wobble * bend[0] / bend[0].std()
        cols = cols + wobble * bend[1] / bend[1].std()
        distance = (rows[..., None] - seeds[:, 0]) ** 2 + (cols[..., None] - seeds[:, 1]) ** 2
        classes = cell_class[distance.argmin(-1)].astype(np.uint8)
        sides = classes[:, :TRAIN_COLUMNS], classes[:, TRAIN_COLUMNS:]
        if all(len(np.unique(side)) == len(CLASSES) for side in sides):
            return classes


def _sparse_polygons(rng: np.random.Generator, classes: np.ndarray) -> np.ndarray:
    """Small polygons (3 to 6 corners, 3 to 7 pixels across) drawn inside the regions of the training columns,
    at least 4 pixels from any border, until LABELLED_FRACTION of those pixels are labelled; IGNORE elsewhere."""
    import cv2
    from scipy.ndimage import distance_transform_edt

    train = classes[:, :TRAIN_COLUMNS]
    border = np.zeros(train.shape, bool)
    border[:-1] |= train[:-1] != train[1:]
    border[:, :-1] |= train[:, :-1] != train[:, 1:]
    inside = distance_transform_edt(~border) >= 4
    sparse = np.full(classes.shape, IGNORE, np.uint8)
    target = LABELLED_FRACTION * train.size
    candidates = np.argwhere(inside)
    while (sparse != IGNORE).sum() < target:
        row, col = candidates[rng.integers(len(candidates))]
        corners = rng.integers(3, 7)
        angles = np.sort(rng.uniform(0, 2 * np.pi, corners))
        radius = rng.uniform(1.5, 3.5, corners)
        points = np.stack([col + radius * np.cos(angles), row + radius * np.sin(angles)], 1).round().astype(np.int32)
        polygon = np.zeros(train.shape, np.uint8)
        cv2.fillPoly(polygon, [points], 1)
        polygon = polygon.astype(bool) & (train == train[row, col])  # a polygon never crosses a border
        sparse[:, :TRAIN_COLUMNS][polygon] = train[row, col]
    return sparse


SEED = 1  # the scene measured in docs/own-data.md: its baseline is the (mIoU 0.35, pixel accuracy 0.54)


def build_scene(seed: int = SEED) -> Scene:
    """The scene of the module docstring, the same for the same `seed`."""
    rng = np.random.default_rng(seed)
    classes = _regions(rng)
    rows, cols = np.mgrid[0:SCENE, 0:SCENE]
    light = 1.0 + 0.1 * (rows / SCENE - 0.5) - 0.08 * (cols / SCENE - 0.5)
    image = np.zeros((SCENE, SCENE, 3))
    for index, (_, texture_name, gains) in enumerate(COVERS):
        texture = _texture(texture_name)
        top, left = rng.integers(0, texture.shape[0] - SCENE), rng.integers(0, texture.shape[1] - SCENE)
        patch = texture[top:top + SCENE, left:left + SCENE]
        where = classes == index
        image[where] = patch[where][:, None] * np.asarray(gains)
    image = image * light[..., None] + rng.normal(0.0, NOISE, image.shape)
    return Scene(np.clip(image.round(), 0, 255).astype(np.uint8), classes, _sparse_polygons(rng, classes))


def write_folder(scene: Scene, root: Path) -> dict[str, list[str]]:
    """The scene as a folder dataset under `root`: images/<row>_<col>.png, masks/<row>_<col>.png (sparse in
    the training columns, dense in the validation ones), train.txt and val.txt. Returns {split: names}."""
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(exist_ok=True)
    splits: dict[str, list[str]] = {"train": [], "val": []}
    for top in range(0, SCENE, TILE):
        for left in range(0, SCENE, TILE):
            name = f"{top // TILE}_{left // TILE}"
            train = left < TRAIN_COLUMNS
            labels = scene.sparse if train else scene.classes
            window = np.s_[top:top + TILE, left:left + TILE]
            Image.fromarray(scene.image[window]).save(root / "images" / f"{name}.png")
            Image.fromarray(labels[window]).save(root / "masks" / f"{name}.png")
            splits["train" if train else "val"].append(name)
    for split, names in splits.items():
        (root / f"{split}.txt").write_text("".join(f"{name}\n" for name in names))
    return splits


def write_export(scene: Scene, root: Path, kind: str) -> None:
    """The scene's tiles and labels as `kind`'s export under `root` (images/, train.txt, val.txt and the export
    that annotation_keys names), from the folder write_folder makes there first."""
    from PIL import Image

    from syncseg.data.annotations import writers

    splits = write_folder(scene, root)
    predictions = [writers.Prediction(file_name=f"{name}.png",
                                      labels=np.asarray(Image.open(root / "masks" / f"{name}.png")))
                   for names in splits.values() for name in names]
    write = {"coco": writers.write_coco, "cvat": writers.write_cvat, "labelme": writers.write_labelme,
             "yolo_seg": writers.write_yolo_seg}[kind]
    if kind == "labelme":  # labelme finds each image beside its JSON file
        for names in splits.values():
            for name in names:
                (root / "labelme").mkdir(exist_ok=True)
                (root / "labelme" / f"{name}.png").write_bytes((root / "images" / f"{name}.png").read_bytes())
    write(predictions, CLASSES, output=root / {"coco": "annotations", "cvat": ".", "labelme": "labelme",
                                                "yolo_seg": "."}[kind], background=None)


def annotation_keys(root: Path, kind: str) -> list[str]:
    """The data.* keys that read the export `write_export` made (its splits by train.txt and val.txt)."""
    export = {"coco": "annotations/predictions.json", "cvat": "annotations.xml", "labelme": "labelme",
              "yolo_seg": "images"}[kind]
    return [f"data.dataset={kind}", f"data.root={root}", f"data.annotations={export}", "data.train_split=train",
            "data.val_split=val"]


def miou_and_accuracy(prediction: np.ndarray, truth: np.ndarray, num_classes: int) -> tuple[float, float]:
    """(mean IoU over the classes present in truth or prediction, pixel accuracy) over the pixels whose truth
    is not IGNORE."""
    valid = truth != IGNORE
    confusion = np.bincount(truth[valid].astype(np.int64) * num_classes + prediction[valid],
                            minlength=num_classes ** 2).reshape(num_classes, num_classes)
    union = confusion.sum(0) + confusion.sum(1) - np.diag(confusion)
    present = union > 0
    iou = np.diag(confusion)[present] / union[present]
    return float(iou.mean()), float(np.diag(confusion).sum() / confusion.sum())


def nearest_centroid(scene: Scene) -> dict[str, float]:
    """The per-pixel baseline: class means of the band values over the labelled training pixels (float64); each
    validation pixel gets the nearest mean's class. Its val mIoU and pixel accuracy, and the share of the
    training columns labelled."""
    values = scene.image.astype(np.float64)
    labelled = scene.sparse != IGNORE
    centroids = np.stack([values[labelled & (scene.sparse == index)].mean(0) for index in range(len(CLASSES))])
    validation = values[:, TRAIN_COLUMNS:].reshape(-1, values.shape[2])
    prediction = ((validation[:, None, :] - centroids[None]) ** 2).sum(-1).argmin(1)
    miou, accuracy = miou_and_accuracy(prediction, scene.classes[:, TRAIN_COLUMNS:].reshape(-1), len(CLASSES))
    return {"miou": miou, "pixel_acc": accuracy,
            "labelled_fraction": float(labelled[:, :TRAIN_COLUMNS].mean())}


def folder_keys(root: Path) -> list[str]:
    """The data.* keys that read the folder `write_folder` made."""
    return ["data.dataset=folder", f"data.root={root}", "data.train_split=train", "data.val_split=val",
            f"data.num_classes={len(CLASSES)}", f"data.class_names={','.join(CLASSES)}"]


def printed_lines(root: Path, keys: Sequence[str] | None = None) -> list[str]:
    """The command line verify_dataset prints for the folder (or the data set `keys` read: data.in_channels,
    max_value, mean, std)."""
    import contextlib
    import io

    from syncseg.commands.verify_dataset import main as verify

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = verify(["--config", "demo.yaml", *(folder_keys(root) if keys is None else keys)])
    if status != 0:
        raise RuntimeError(f"verify_dataset found bad samples in {root}:\n{out.getvalue()}")
    (line,) = [line for line in out.getvalue().splitlines() if line.startswith("  command line: ")]
    return line.split(": ", 1)[1].split()


def train_config(config: str, root: Path, run_dir: Path, overrides: Sequence[str] = (),
                 keys: Sequence[str] | None = None) -> dict[str, float]:
    """train.py --config `config` on the folder (or the data set `keys` read) with verify_dataset's lines and
    `overrides`; the best validation's mIoU and pixel accuracy (metrics.jsonl) and the seconds it took."""
    import time

    from syncseg.commands.train import main as train

    keys = folder_keys(root) if keys is None else list(keys)
    start = time.perf_counter()
    status = train(["--config", config, *keys, *printed_lines(root, keys), f"output_dir={run_dir}",
                    "--overwrite", *overrides])
    seconds = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"train.py --config {config} exited with {status}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [record for record in records if record["type"] == "val"]
    best = max(validations, key=lambda record: record["miou"])
    return {"miou": best["miou"], "pixel_acc": best["pixel_acc"], "iteration": best["iteration"],
            "last_miou": validations[-1]["miou"], "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="folder to write the data set in")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the scene's seed (default {SEED}: the one measured)")
    parser.add_argument("--train", nargs="*", default=[], metavar="CONFIG_OR_KEY=VALUE",
                        help="configs to train on it, then KEY=VALUE overrides for all of them")
    parser.add_argument("--format", default="folder", choices=("folder", "coco", "cvat", "labelme", "yolo_seg"),
                        help="write the labels as this annotation tool's export (default: a folder of PNG masks)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    scene = build_scene(args.seed)
    if args.format == "folder":
        write_folder(scene, root / "data")
        keys = None
    else:
        write_export(scene, root / "data", args.format)
        keys = annotation_keys(root / "data", args.format)
    baseline = nearest_centroid(scene)
    print(f"scene seed {args.seed}: {len(CLASSES)} classes ({', '.join(CLASSES)}), {SCENE}x{SCENE} px in "
          f"{(SCENE // TILE) ** 2} tiles of {TILE}; {100 * baseline['labelled_fraction']:.2f}% of the training "
          f"pixels labelled")
    print(f"{'per-pixel nearest centroid':<40} val mIoU {baseline['miou']:.4f}  pixel acc {baseline['pixel_acc']:.4f}")
    configs = [item for item in args.train if "=" not in item]
    overrides = [item for item in args.train if "=" in item]
    for config in configs:
        name = Path(config).stem
        result = train_config(config, root / "data", root / "runs" / name, overrides, keys=keys)
        verdict = "beats" if result["miou"] > baseline["miou"] else "does NOT beat"
        print(f"{name + ' ' + ' '.join(overrides):<40} val mIoU {result['miou']:.4f}  pixel acc "
              f"{result['pixel_acc']:.4f}  (best at iteration {result['iteration']}, last {result['last_miou']:.4f}; "
              f"{result['seconds']:.0f} s): {verdict} the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
