"""Each annotation format end to end (issue 48): its export trains with train.py, evaluates with eval.py and
predicts with predict.py --format, whose files read back (through the same data set kind) to the masks
predict.py wrote. The exports are written from synthetic shapes by the formats' writers (Label Studio's by its
brush RLE), images and masks of 40 px."""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from PIL import Image

from syncseg import data
from syncseg.data.annotations import writers
from syncseg.data.annotations.codecs import encode_brush_rle
from syncseg.data.synthetic import render_shapes
from syncseg.engine.config import DataConfig
from tests.e2e.common import TINY_BASE, read_metrics

SIZE, COUNT, NUM_CLASSES = 40, 10, 4
CLASSES = ["background", "disk", "box", "blob"]
TRAIN = ["model.aux_loss=false", "train.iters=3", "train.val_interval=3", "train.ckpt_interval=3",
         "train.num_vis_images=0", "train.amp=off", "eval.amp=off", "eval.batch_size=2", "data.crop_size=32",
         "train.batch_size=4", "model.channels_last=false"]


def _samples():
    samples = {}
    for index in range(COUNT):
        image, mask = render_shapes(np.random.default_rng([7, index]), SIZE, num_classes=NUM_CLASSES)
        samples[f"s{index:02d}"] = (image, mask.astype(np.uint8))
    return samples


def _export(kind, root, samples):
    """The export of `samples` in `kind`'s format under `root`; returns the data.* settings that read it."""
    def save_images(folder):
        for name, (image, _) in samples.items():
            (root / folder).mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(root / folder / f"{name}.png")

    predictions = [writers.Prediction(file_name=f"{name}.png", labels=mask) for name, (_, mask) in samples.items()]
    names = sorted(samples)
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.txt").write_text("\n".join(names[:7]) + "\n")
    (root / "val.txt").write_text("\n".join(names[7:]) + "\n")
    if kind == "coco":
        save_images("images")
        writers.write_coco(predictions, CLASSES, output=root / "annotations", background=0, category_ids=[0, 4, 9, 2])
        return ["data.annotations=annotations/predictions.json"]
    if kind == "cvat":
        save_images("images")
        writers.write_cvat(predictions, CLASSES, output=root, background=0)
        return ["data.annotations=annotations.xml"]
    if kind == "labelme":
        save_images("labelme")
        writers.write_labelme(predictions, CLASSES, output=root / "labelme", background=0)
        return ["data.annotations=labelme"]
    if kind == "yolo_seg":
        save_images("images")
        writers.write_yolo_seg(predictions, CLASSES, output=root, background=0)
        return ["data.annotations=images"]
    save_images("images")  # Label Studio: brushes of the shapes, sparse (uncovered pixels ignored)
    tasks = []
    for number, (name, (_, mask)) in enumerate(samples.items()):
        result = [{"id": f"{name}-{value}", "type": "brushlabels", "original_width": SIZE, "original_height": SIZE,
                   "value": {"format": "rle", "brushlabels": [CLASSES[value]],
                             "rle": encode_brush_rle(np.repeat((mask == value).reshape(-1).astype(np.uint8) * 255, 4))}}
                  for value in np.unique(mask) if value > 0]
        tasks.append({"id": number, "data": {"image": f"/data/upload/1/{name}.png"},
                      "annotations": [{"result": result}]})
    (root / "export.json").write_text(json.dumps(tasks))
    return ["data.annotations=export.json", "data.uncovered=ignore"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["coco", "labelme", "cvat", "yolo_seg", "label_studio"])
def test_an_export_trains_evaluates_and_predicts_back_into_its_format(tmp_path, kind):
    samples = _samples()
    root = tmp_path / "export"
    settings = [f"data.dataset={kind}", f"data.root={root}", *_export(kind, root, samples)]
    run_dir = tmp_path / "run"
    train = importlib.import_module("syncseg.commands.train")
    assert train.main(["--config", "demo.yaml", *TINY_BASE, *TRAIN, *settings, f"output_dir={run_dir}",
                       "name=run"]) == 0
    validations = [record for record in read_metrics(run_dir) if record["type"] == "val"]
    assert validations and 0 <= validations[-1]["miou"] <= 1 and validations[-1]["num_images"] == 3
    evaluate = importlib.import_module("syncseg.commands.eval")
    assert evaluate.main(["--checkpoint", str(run_dir / "best.pt"), "--device", "cpu", "--no-progress"]) == 0
    if kind == "label_studio":
        return  # predict.py writes no Label Studio files
    images = tmp_path / "photos"
    for name, (image, _) in list(samples.items())[:3]:
        (images / "sub").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(images / "sub" / f"{name}.png")
    out = tmp_path / "out"
    predict = importlib.import_module("syncseg.commands.predict")
    assert predict.main(["--checkpoint", str(run_dir / "best.pt"), "--input", str(images), "--output", str(out),
                         "--device", "cpu", "--format", kind]) == 0
    predicted = {name: np.asarray(Image.open(out / "sub" / f"{name}_mask.png")) for name in list(samples)[:3]}
    # read back as the same kind: the tool's files beside the images, as the tool is given them
    back = out / kind
    if kind == "coco":
        document = json.loads((back / "predictions.json").read_text())
        assert {c["id"] for c in document["categories"]} <= {4, 9, 2}  # the training file's category ids
        reread = {"annotations": "coco/predictions.json"}
        root_for = out
        for name in predicted:
            (out / "images" / "sub").mkdir(parents=True, exist_ok=True)
            (out / "images" / "sub" / f"{name}.png").write_bytes((images / "sub" / f"{name}.png").read_bytes())
    elif kind == "cvat":
        reread, root_for = {"annotations": "cvat/annotations.xml"}, out
        for name in predicted:
            (out / "images" / "sub").mkdir(parents=True, exist_ok=True)
            (out / "images" / "sub" / f"{name}.png").write_bytes((images / "sub" / f"{name}.png").read_bytes())
    elif kind == "labelme":
        for name in predicted:
            (back / "sub" / f"{name}.png").write_bytes((images / "sub" / f"{name}.png").read_bytes())
        reread, root_for = {"annotations": "labelme"}, out
    else:
        for name in predicted:
            (back / "images" / "sub").mkdir(parents=True, exist_ok=True)
            (back / "images" / "sub" / f"{name}.png").write_bytes((images / "sub" / f"{name}.png").read_bytes())
        reread, root_for = {}, back
    training = data.build_dataset(DataConfig(dataset=kind, root=str(root), annotations=settings[2].split("=", 1)[1]),
                                  "all", train=False)
    dataset = data.build_dataset(DataConfig(dataset=kind, root=str(root_for), **reread), "all", train=False)
    assert dataset.classes == training.classes  # names (and COCO ids) as in the training file
    for index in range(len(dataset)):
        np.testing.assert_array_equal(dataset.load(index)[1], predicted[dataset.name_of(index)])


def test_train_py_refuses_a_bad_export_at_start_with_one_line(tmp_path, capsys):
    samples = _samples()
    root = tmp_path / "export"
    settings = ["data.dataset=coco", f"data.root={root}", *_export("coco", root, samples)]
    document = json.loads((root / "annotations" / "predictions.json").read_text())
    document["annotations"][0]["category_id"] = 77
    (root / "annotations" / "predictions.json").write_text(json.dumps(document))
    train = importlib.import_module("syncseg.commands.train")
    assert train.main(["--config", "demo.yaml", *TINY_BASE, *TRAIN, *settings, f"output_dir={tmp_path / 'run'}"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "predictions.json' annotation 1: category_id 77 is not in 'categories'" in error[0]
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["coco", "labelme", "cvat", "yolo_seg", "label_studio"])
def test_the_hand_made_exports_train(tmp_path, kind):
    """The small exports of tests/data/annotation_exports.py (overlaps, a hole, RLE or brushes, an ignored region,
    uncovered pixels; labelme's embedded image) through train.py: validated on the training split itself."""
    from tests.data import annotation_exports as exports

    root = tmp_path / "export"
    split = {"coco": "train", "labelme": "train", "cvat": "all", "yolo_seg": "train", "label_studio": "all"}[kind]
    if kind == "label_studio":
        exports.make_label_studio(root, encode=lambda mask: encode_brush_rle(
            np.repeat(mask.reshape(-1).astype(np.uint8) * 255, 4)))
    else:
        {"coco": exports.make_coco, "labelme": exports.make_labelme, "cvat": exports.make_cvat,
         "yolo_seg": exports.make_yolo}[kind](root)
    settings = [f"data.dataset={kind}", f"data.root={root}", f"data.train_split={split}", f"data.val_split={split}",
                "train.iters=2", "train.val_interval=2", "train.ckpt_interval=2", "train.batch_size=2",
                "eval.batch_size=1"]
    train = importlib.import_module("syncseg.commands.train")
    assert train.main(["--config", "demo.yaml", *TINY_BASE, *TRAIN, *settings, f"output_dir={tmp_path / 'run'}"]) == 0
    validation = [record for record in read_metrics(tmp_path / "run") if record["type"] == "val"][-1]
    assert validation["num_images"] == len(data.build_dataset(
        DataConfig(dataset=kind, root=str(root)), split, train=False))
