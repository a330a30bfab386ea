"""The Python API (syncseg/api.py, issue 29 item 3): build_model from plain keywords, load_model + predict
against predict.py and a float64 re-computation, the README's example run as written, and a light import."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import syncseg
from syncseg.engine.config import load_config
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d
from tests.checkpoints import save_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1,2,3"]


def test_build_model_takes_the_model_keys_as_keywords():
    from syncseg.model.builder import build_model as build_from_config

    torch.manual_seed(0)
    model = syncseg.build_model(arch="deeplabv3", backbone="resnet18", num_classes=5, norm="syncbn",
                                output_stride=8, aux_loss=True, head_channels=16)
    torch.manual_seed(0)
    reference = build_from_config(load_config(None, ["model.arch=deeplabv3", "model.backbone=resnet18",
                                                     "model.output_stride=8", "model.aux_loss=true",
                                                     "model.head_channels=16"]).model, 5)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(value, reference.state_dict()[key]) for key, value in model.state_dict().items())
    assert any(isinstance(module, SynchronizedBatchNorm2d) for module in model.modules())
    output = model.eval()(torch.randn(1, 3, 40, 40))
    assert output["out"].shape == (1, 5, 40, 40) and "aux" in output
    plain = syncseg.build_model(backbone="resnet18", num_classes=3, norm="bn", in_channels=4)
    assert not any(isinstance(module, SynchronizedBatchNorm2d) for module in plain.modules())
    assert plain.eval()(torch.randn(1, 4, 32, 32))["out"].shape == (1, 3, 32, 32)


@pytest.mark.parametrize("keywords,message", [
    ({"backbone": "resnet19"}, r"model.backbone='resnet19' is not one of"),
    ({"outputstride": 8}, r"unknown config key 'model.outputstride'; did you mean 'model.output_stride'"),
    ({"in_channels": 0}, r"in_channels=0 must be a positive integer"),
    ({"num_classes": 0}, r"num_classes=0 must be a positive integer"),
])
def test_build_model_names_a_bad_keyword(keywords, message):
    with pytest.raises(ValueError, match=message):
        syncseg.build_model(**{"backbone": "resnet18", **keywords})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    config, model = save_random_checkpoint(path, TINY, ["background", "a", "b", "c"], seed=3, iteration=7)
    return path, config, model


def test_load_model_predicts_as_predict_py_and_a_float64_recomputation(checkpoint, tmp_path):
    path, config, model = checkpoint
    image = np.random.default_rng(1).integers(0, 256, (37, 45, 3), dtype=np.uint8)
    Image.fromarray(image).save(tmp_path / "photo.png")
    predictor = syncseg.load_model(path)
    assert predictor.classes == ["background", "a", "b", "c"] and predictor.iteration == 7
    from syncseg.data.registry import dataset_kind

    assert np.array_equal(predictor.palette, dataset_kind(config.data.dataset).palette_for(4))
    from_array = predictor.predict(image)
    assert from_array.shape == (37, 45) and from_array.dtype == np.int64
    assert np.array_equal(predictor.predict(tmp_path / "photo.png"), from_array)
    assert np.array_equal(syncseg.predict(predictor, image), from_array)
    # predict.py's mask file for the same image
    from syncseg.commands import predict

    assert predict.main(["--checkpoint", str(path), "--input", str(tmp_path / "photo.png"), "--output",
                         str(tmp_path / "out"), "--device", "cpu"]) == 0
    assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / "photo_mask.png")), from_array)
    # the model on the image normalized in float64, independently of syncseg.data.transforms
    mean = torch.tensor(config.data.mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(config.data.std, dtype=torch.float64).view(1, 3, 1, 1)
    inputs = ((torch.from_numpy(image).permute(2, 0, 1)[None].double() / 255 - mean) / std).float()
    with torch.no_grad():
        logits = model(inputs)["out"][0]
    assert torch.allclose(predictor.predict_logits(image), logits, atol=1e-4)


def test_predict_names_an_image_that_does_not_fit(checkpoint):
    predictor = syncseg.load_model(checkpoint[0])
    with pytest.raises(ValueError, match=r"expected H x W x 3 \(data.in_channels=3"):
        predictor.predict(np.zeros((8, 8, 4), np.uint8))
    with pytest.raises(ValueError, match="image of dtype float32: expected uint8"):
        predictor.predict(np.zeros((8, 8, 3), np.float32))
    with pytest.raises(FileNotFoundError):
        syncseg.load_model(checkpoint[0].parent / "missing.pt")


def test_importing_syncseg_imports_nothing_heavy():
    code = ("import sys, syncseg; names = syncseg.__all__; "
            "heavy = [m for m in ('torch', 'cv2', 'albumentations', 'numpy', 'syncseg.api', 'syncseg.engine') "
            "if m in sys.modules]; assert not heavy, heavy; assert 'train' in names and 'build_model' in names")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        syncseg.trian


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md's Python API section has no ```python block"
    return match.group(1)


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path):
    """The README's Python API block, unchanged, in a fresh folder (its runs/ lands there): it trains the
    demo config for a few iterations, loads best.pt and predicts the demo image."""
    example = _readme_example()
    assert "syncseg.train(" in example and "syncseg.load_model(" in example and "syncseg.build_model(" in example
    done = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "SYNCSEG_NATIVE_BF16": "0",
                               # the cores this pytest worker has (tests/conftest.py), 2 in a serial run
                               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    iteration, best_miou, run_dir = lines[-2].split(" ", 2)
    assert int(iteration) == 20 and 0.0 <= float(best_miou) <= 1.0
    assert (tmp_path / run_dir / "best.pt").is_file() and (tmp_path / run_dir / "metrics.jsonl").is_file()
    assert lines[-1].endswith("(96, 96)") and "'background'" in lines[-1]
