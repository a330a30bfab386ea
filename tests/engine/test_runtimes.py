"""--runtime onnxruntime / openvino: masks against PyTorch fp32's through the same pre-processing, the export
cache, the checks of a given export, and the int8 export's mIoU report and threshold."""
from __future__ import annotations

import importlib
import json
import re
import sys

import numpy as np
import pytest
import torch

import syncseg
from syncseg.engine import runtimes
from tests.checkpoints import SIX_BANDS as SIX_BAND_DATA
from tests.checkpoints import TINY_MODEL, save_random_checkpoint, unexplained_differences

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

DEMO = TINY_MODEL
SIX_BANDS = [*DEMO, *SIX_BAND_DATA]
CLASSES = ["background", "a", "b", "c"]


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "best.pt"
    save_random_checkpoint(path, DEMO, CLASSES, seed=3, iteration=10)
    return path


@pytest.fixture(scope="module")
def six_band_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("six") / "best.pt"
    save_random_checkpoint(path, SIX_BANDS, CLASSES, seed=4, iteration=10)
    return path


def _image(channels: int, dtype, size=(70, 90), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    high = 256 if dtype == np.uint8 else 65536
    return rng.integers(0, high, size=(*size, channels)).astype(dtype)


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("mode", [["eval.mode=whole"],
                                  ["eval.mode=slide", "eval.window_size=48", "eval.stride=32", "eval.flip=true",
                                   "eval.scales=0.75,1.0"]])
@pytest.mark.parametrize("which", ["demo", "six_band"])
def test_masks_equal_pytorch_fp32(runtime, mode, which, request):
    checkpoint = request.getfixturevalue(f"{which}_checkpoint")
    image = _image(3, np.uint8) if which == "demo" else _image(6, np.uint16)
    reference = syncseg.load_model(checkpoint, overrides=mode).predict_logits(image)
    predictor = syncseg.load_model(checkpoint, overrides=mode, runtime=runtime, threads=1)
    assert isinstance(predictor.model, runtimes.RuntimeModel) and predictor.model.precision == "fp32"
    logits = predictor.predict_logits(image)
    assert logits.shape == reference.shape == (len(CLASSES), 70, 90)
    differ, unexplained = unexplained_differences(reference, logits.argmax(0))
    assert unexplained == 0 and differ <= 0.001 * 70 * 90, (differ, unexplained)
    assert float((logits - reference).abs().max()) <= 1e-3 * max(1.0, float(reference.abs().max()))


def test_the_export_is_cached_beside_the_checkpoint_and_reused(demo_checkpoint, monkeypatch):
    syncseg.load_model(demo_checkpoint, runtime="onnxruntime")
    cached = list((demo_checkpoint.parent / runtimes.CACHE_FOLDER).glob("*.onnx"))
    assert len(cached) == 1 and cached[0].name.startswith("best-")
    metadata = runtimes.read_metadata(cached[0])
    assert metadata["checkpoint_sha256"] == runtimes.file_digest(demo_checkpoint)
    monkeypatch.setattr("syncseg.engine.export_formats.export_model",
                        lambda *args, **kwargs: pytest.fail("exported again"))
    syncseg.load_model(demo_checkpoint, runtime="openvino")  # the same file serves both runtimes


def test_an_unwritable_checkpoint_folder_caches_in_the_user_cache(tmp_path, monkeypatch):
    checkpoint = tmp_path / "run" / "best.pt"
    checkpoint.parent.mkdir()
    save_random_checkpoint(checkpoint, DEMO, CLASSES, seed=3, iteration=1)
    (checkpoint.parent / runtimes.CACHE_FOLDER).write_text("a file where the folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    predictor = syncseg.load_model(checkpoint, runtime="onnxruntime")
    assert predictor.model.path.parent == tmp_path / "cache" / "syncseg" / "exports"


def test_an_export_of_another_checkpoint_is_refused(demo_checkpoint, six_band_checkpoint, tmp_path):
    other = tmp_path / "other.pt"
    save_random_checkpoint(other, [*DEMO[:-1], "eval.amp=off"], ["background", "x"], seed=5, iteration=1)
    two_classes = syncseg.load_model(other, runtime="onnxruntime").model.path
    with pytest.raises(ValueError, match=rf"'{re.escape(str(two_classes))}' predicts 2 classes, checkpoint "
                                         rf"'{re.escape(str(demo_checkpoint))}' 4"):
        syncseg.load_model(demo_checkpoint, runtime="onnxruntime", exported=two_classes)
    six = syncseg.load_model(six_band_checkpoint, runtime="onnxruntime").model.path
    with pytest.raises(ValueError, match=r"exported with in_channels=6, checkpoint .* has 3"):
        syncseg.load_model(demo_checkpoint, runtime="onnxruntime", exported=six)
    same_config = tmp_path / "same.pt"
    save_random_checkpoint(same_config, DEMO, CLASSES, seed=6, iteration=1)
    with pytest.raises(ValueError, match=r"exported from another checkpoint than"):
        syncseg.load_model(demo_checkpoint, runtime="openvino",
                           exported=syncseg.load_model(same_config, runtime="onnxruntime").model.path)


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_a_file_that_is_not_an_onnx_model_is_one_error_line_and_exit_2(demo_checkpoint, runtime, tmp_path, capsys):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model" * 10)
    predict = importlib.import_module("syncseg.commands.predict")
    image = tmp_path / "image.png"
    from PIL import Image

    Image.fromarray(_image(3, np.uint8)).save(image)
    status = predict.main(["--checkpoint", str(demo_checkpoint), "--input", str(image), "--output",
                           str(tmp_path / "out"), "--runtime", runtime, "--exported", str(broken)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert f"'{broken}' is not an ONNX model" in lines[0]


def test_a_runtime_not_installed_names_the_extra(demo_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino raises ImportError
    with pytest.raises(runtimes.RuntimeNotInstalled, match=r"openvino is not installed \(pip install "
                                                           r"\"syncseg\[openvino\]\"\)"):
        syncseg.load_model(demo_checkpoint, runtime="openvino")


def test_precision_follows_eval_amp(demo_checkpoint, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr("syncseg.engine.devices.native_bf16", lambda device: True)
    assert runtimes.runtime_precision("openvino", "auto", cpu)[0] == "bf16"
    assert runtimes.runtime_precision("openvino", "off", cpu)[0] == "fp32"
    assert runtimes.runtime_precision("onnxruntime", "auto", cpu)[0] == "fp32"
    with pytest.raises(ValueError, match=r"eval.amp=bf16: onnxruntime runs fp32"):
        runtimes.runtime_precision("onnxruntime", "bf16", cpu)
    with pytest.raises(ValueError, match=r"eval.amp=fp16: openvino on the CPU runs fp32 or bf16"):
        runtimes.runtime_precision("openvino", "fp16", cpu)
    monkeypatch.setattr("syncseg.engine.devices.native_bf16", lambda device: False)
    assert runtimes.runtime_precision("openvino", "auto", cpu)[0] == "fp32"


def test_options_of_a_runtime_are_refused_with_torch(demo_checkpoint):
    with pytest.raises(ValueError, match=r"exported= and threads= apply to runtime='onnxruntime'"):
        syncseg.load_model(demo_checkpoint, threads=2)


# A model trained for 80 steps on 64 px synthetic shapes (~15 s on 2 cores): int8 needs weights whose ranges
# mean something, and its mIoU comparison needs a model that beats predicting one class.
TRAINED = ["data.synthetic_image_size=64", "data.crop_size=64", "data.synthetic_train_size=200",
           "data.synthetic_val_size=24", "data.num_workers=0", "model.head_channels=32", "train.iters=80",
           "train.val_interval=80", "train.ckpt_interval=80", "train.num_vis_images=0", "train.log_interval=20"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    syncseg.train("demo.yaml", [*TRAINED, f"output_dir={run_dir}"], resume=None, gpus="cpu", progress=False)
    return run_dir / "best.pt"


def _export(checkpoint, *extra, folder="export"):
    export = importlib.import_module("syncseg.commands.export")
    output = checkpoint.parent / folder / "best.onnx"
    return export.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--output", str(output), *extra]), output


def _constant_miou(config_overrides) -> float:
    """mIoU of predicting the most frequent class of the validation masks everywhere: the baseline."""
    from syncseg.data import build_dataset
    from syncseg.engine.config import load_config

    config = load_config("demo.yaml", config_overrides)
    dataset = build_dataset(config.data, config.data.val_split, train=False, compact_masks=True)
    counts = np.zeros(256, np.int64)
    for index in range(len(dataset)):
        counts += np.bincount(np.asarray(dataset[index][1]).ravel(), minlength=256)[:256]
    present = counts[:255] > 0
    return float(counts[:255].max() / counts[:255].sum()) / int(present.sum())  # IoU of one class, 0 elsewhere


@pytest.mark.slow
def test_eval_on_each_runtime_reports_it_and_the_same_miou(trained, tmp_path):
    evaluate = importlib.import_module("syncseg.commands.eval")
    reports = {}
    for runtime in ("torch", "onnxruntime", "openvino"):
        output = tmp_path / f"{runtime}.json"
        assert evaluate.main(["--checkpoint", str(trained), "--no-progress", "--runtime", runtime,
                              "--output", str(output), "eval.amp=off"]) == 0
        reports[runtime] = json.loads(output.read_text())
    for runtime in ("onnxruntime", "openvino"):
        protocol = reports[runtime]["protocol"]
        assert protocol["runtime"] == runtime and protocol["amp"] == "fp32"
        assert protocol["exported"].endswith(".onnx")
        assert reports[runtime]["miou"] == pytest.approx(reports["torch"]["miou"], abs=1e-3)
    assert reports["torch"]["miou"] > _constant_miou(TRAINED) + 0.02


@pytest.mark.slow
def test_int8_export_reports_its_miou_beside_fp32_and_predicts_on_both_runtimes(trained, caplog, tmp_path):
    caplog.set_level("INFO")
    status, output = _export(trained, "--int8", "--calibrate", "16")
    assert status == 0
    int8 = output.with_name("best.int8.onnx")
    metadata = runtimes.read_metadata(int8)
    assert metadata["precision"] == "int8" and metadata["calibration_images"] == 16
    assert metadata["checkpoint_sha256"] == runtimes.file_digest(trained)
    report = [record.getMessage() for record in caplog.records if "validation mIoU fp32" in record.getMessage()]
    assert len(report) == 1, [record.getMessage() for record in caplog.records]
    fp32, int8_miou, drop = (float(value) for value in
                             re.search(r"fp32 ([\d.]+), int8 ([\d.]+) \(drop (-?[\d.]+) points", report[0]).groups())
    assert fp32 > 100 * (_constant_miou(TRAINED) + 0.02)  # the model learned something int8 can lose
    assert drop == pytest.approx(fp32 - int8_miou, abs=0.011) and drop <= 1.0
    image = syncseg.demo_image(2, size=64)
    reference = syncseg.load_model(trained, overrides=["eval.amp=off"]).predict(image)
    for runtime in ("onnxruntime", "openvino"):
        predictor = syncseg.load_model(trained, runtime=runtime, exported=int8, threads=1)
        mask = predictor.predict(image)
        assert mask.shape == reference.shape and float((mask == reference).mean()) > 0.95, runtime


@pytest.mark.slow
@pytest.mark.parametrize("on_drop", ["refuse", "warn"])
def test_a_broken_calibration_is_refused_by_the_threshold(trained, on_drop, monkeypatch, capsys, caplog):
    def zeros(config, num_classes, count, **kwargs):  # every range collapses onto 0: int8 sees a blank image
        channels = config.data.in_channels
        return [np.zeros((1, channels, 64, 64), np.float32) for _ in range(count)]

    monkeypatch.setattr("syncseg.engine.int8.calibration_inputs", zeros)
    status, output = _export(trained, "--int8", "--calibrate", "4", "--on-drop", on_drop, folder=on_drop)
    int8 = output.with_name("best.int8.onnx")
    error = capsys.readouterr().err
    if on_drop == "refuse":
        assert status == 1 and not int8.exists()
        assert "int8 loses more than --max-miou-drop 1" in error and f"removed '{int8}'" in error
    else:
        warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
        assert status == 0 and int8.exists()
        assert any("int8 loses more than --max-miou-drop 1" in line and "kept" in line for line in warnings)
    assert output.exists()  # the checked fp32 file stays either way


@pytest.mark.slow
def test_a_calibration_split_smaller_than_n_is_exit_2_before_writing(trained, capsys):
    status, output = _export(trained, "--int8", "--calibrate", "500", folder="too-few")
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1
    assert "--calibrate 500: data.train_split 'train' of data.dataset=synthetic has only 200 images" in lines[0]
    assert not output.parent.exists() or not list(output.parent.glob("*.onnx"))


def test_int8_with_another_format_is_exit_2(demo_checkpoint, tmp_path, capsys):
    export = importlib.import_module("syncseg.commands.export")
    status = export.main(["--checkpoint", str(demo_checkpoint), "--format", "torchscript", "--int8",
                          "--output", str(tmp_path / "m.torchscript.pt")])
    assert status == 2 and "--int8 quantizes an ONNX file: use it with --format onnx" in capsys.readouterr().err
    assert not (tmp_path / "m.torchscript.pt").exists()


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_images_of_one_size_are_predicted_together_as_one_by_one(demo_checkpoint, runtime, tmp_path):
    predictor = syncseg.load_model(demo_checkpoint, runtime=runtime)
    images = [_image(3, np.uint8, seed=1), _image(3, np.uint8, seed=2), _image(3, np.uint8, size=(50, 60), seed=3),
              _image(3, np.uint8, seed=4), _image(3, np.uint8, seed=5)]
    batches = []
    hook = predictor.model.register_forward_pre_hook(lambda module, args: batches.append(len(args[0])))
    masks = predictor.predict_many(images, batch_size=2)
    hook.remove()
    assert batches == [2, 1, 2]  # 70x90 twice, the 50x60 alone, then the last two 70x90
    for image, mask in zip(images, masks):
        assert mask.shape == image.shape[:2]
        assert unexplained_differences(predictor.predict_logits(image), torch.from_numpy(mask))[1] == 0
    # predict.py --batch-size writes the same masks as the API
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for index, image in enumerate(images):
        Image.fromarray(image).save(folder / f"{index}.png")
    predict = importlib.import_module("syncseg.commands.predict")
    extra = [] if runtime == "torch" else ["--runtime", runtime]
    assert predict.main(["--checkpoint", str(demo_checkpoint), "--input", str(folder), "--output",
                         str(tmp_path / "out"), "--batch-size", "3", "--device", "cpu", *extra]) == 0
    for index, mask in enumerate(masks):
        assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / f"{index}_mask.png")), mask)
