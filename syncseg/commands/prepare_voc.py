"""Build VOC2012 `train_aug` (the 10,582-image SBD-augmented training set) from an extracted SBD release.

    python -m syncseg prepare-voc --voc-root data/VOCdevkit/VOC2012 --sbd-root data/benchmark_RELEASE

Inputs: the VOC2012 folder (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/{train,val}.txt) and
SBD (`benchmark_RELEASE/dataset/cls/<id>.mat`, with dataset/{train,val}.txt). Output, inside the VOC
folder: SegmentationClassAug/<id>.png (grayscale index PNGs, 255 = ignore) and
ImageSets/Segmentation/train_aug.txt listing (SBD train + SBD val + VOC train) minus VOC val.
An image with a VOC annotation keeps it (it marks object boundaries 255); the others take SBD's.
Exit status and error lines: syncseg/engine/cli.py (2 for a missing folder or file, naming it).
"""
from __future__ import annotations

import argparse
import logging
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# numpy, PIL and scipy are imported where used, so that --help answers at once.

logger = logging.getLogger("prepare_voc")

EXPECTED_TRAIN_AUG = 10582


def read_ids(path: Path) -> list[str]:
    return [line.split()[0] for line in path.read_text().splitlines() if line.strip()]


def load_sbd_mask(mat_path: Path) -> Any:
    """The class-index mask (HxW uint8 numpy array) of one SBD `cls/<id>.mat` (struct GTcls, field Segmentation)."""
    import numpy as np
    from scipy.io import loadmat

    try:
        record = loadmat(str(mat_path), squeeze_me=True, struct_as_record=False)["GTcls"]
        mask = np.asarray(record.Segmentation)
    except (KeyError, AttributeError, ValueError, OSError) as error:
        raise ValueError(f"'{mat_path}' is not an SBD cls file (struct GTcls.Segmentation): {error}") from None
    if mask.ndim != 2 or mask.size == 0 or mask.max() > 20:
        raise ValueError(f"'{mat_path}': expected an HxW mask with classes 0..20, got shape {mask.shape}")
    return mask.astype(np.uint8)


def resolve_sbd_dataset(sbd_root: Path) -> Path:
    for candidate in (sbd_root / "dataset", sbd_root):
        if (candidate / "cls").is_dir():
            return candidate
    raise FileNotFoundError(
        f"SBD folder '{sbd_root}' has no cls/ (expected benchmark_RELEASE/dataset/cls/<id>.mat, "
        "from http://home.bharathh.info/pubs/codes/SBD/download.html, extracted)"
    )


def convert_one(job: tuple[str, str, str, str]) -> str:
    """Write one SegmentationClassAug PNG; returns the id."""
    import numpy as np
    from PIL import Image

    image_id, voc_png, sbd_mat, out_png = job
    if voc_png:
        with Image.open(voc_png) as image:
            mask = np.asarray(image)
    else:
        mask = load_sbd_mask(Path(sbd_mat))
    Image.fromarray(mask.astype(np.uint8), mode="L").save(out_png)
    return image_id


def prepare(voc_root: Path, sbd_root: Path, *, workers: int = 4) -> list[str]:
    """Writes SegmentationClassAug/ and train_aug.txt under voc_root; returns the train_aug ids."""
    lists = voc_root / "ImageSets" / "Segmentation"
    for required in (voc_root / "JPEGImages", lists / "train.txt", lists / "val.txt"):
        if not required.exists():
            raise FileNotFoundError(
                f"'{required}' not found: --voc-root must be a VOC2012 folder with JPEGImages/, "
                "SegmentationClass/ and ImageSets/Segmentation/{train,val}.txt"
            )
    sbd = resolve_sbd_dataset(sbd_root)
    sbd_ids = set()
    for name in ("train.txt", "val.txt"):
        if (sbd / name).is_file():
            sbd_ids.update(read_ids(sbd / name))
    if not sbd_ids:
        sbd_ids = {p.stem for p in (sbd / "cls").glob("*.mat")}
    voc_val = set(read_ids(lists / "val.txt"))
    ids = sorted((sbd_ids | set(read_ids(lists / "train.txt"))) - voc_val)
    missing_images = [i for i in ids if not (voc_root / "JPEGImages" / f"{i}.jpg").is_file()]
    if missing_images:
        raise FileNotFoundError(f"{len(missing_images)} train_aug images missing from '{voc_root / 'JPEGImages'}' "
                                f"(first: {missing_images[0]}.jpg)")
    out_dir = voc_root / "SegmentationClassAug"
    out_dir.mkdir(exist_ok=True)
    jobs = []
    for image_id in ids:
        voc_png = voc_root / "SegmentationClass" / f"{image_id}.png"
        sbd_mat = sbd / "cls" / f"{image_id}.mat"
        if not voc_png.is_file() and not sbd_mat.is_file():
            raise FileNotFoundError(f"no annotation for '{image_id}': neither '{voc_png}' nor '{sbd_mat}' exists")
        jobs.append((image_id, str(voc_png) if voc_png.is_file() else "", str(sbd_mat), str(out_dir / f"{image_id}.png")))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(convert_one, jobs, chunksize=64))
    else:
        for job in jobs:
            convert_one(job)
    (lists / "train_aug.txt").write_text("".join(f"{i}\n" for i in ids))
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--voc-root", required=True, type=Path, help="the VOC2012 folder")
    parser.add_argument("--sbd-root", required=True, type=Path, help="extracted SBD (benchmark_RELEASE)")
    parser.add_argument("--workers", type=int, default=4,
                        help="processes converting the masks in parallel (default 4; 1 converts in this process)")
    args = parser.parse_args(argv)
    from syncseg.engine.cli import TIME_FORMAT, run_command  # exit statuses and error lines: syncseg/engine/cli.py

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt=TIME_FORMAT)
    return run_command("syncseg-prepare-voc", lambda: _prepare_and_report(args))


def _prepare_and_report(args: argparse.Namespace) -> int:
    ids = prepare(args.voc_root, args.sbd_root, workers=args.workers)
    note = "" if len(ids) == EXPECTED_TRAIN_AUG else f" (the full SBD + VOC2012 gives {EXPECTED_TRAIN_AUG})"
    logger.info("wrote %d masks to %s and %s%s", len(ids), args.voc_root / "SegmentationClassAug",
                args.voc_root / "ImageSets" / "Segmentation" / "train_aug.txt", note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
