"""export.py --deepness: the file read as the QGIS Deepness plugin reads it (its input shape, metadata keys and
preprocessing: a real texture tile / 255, NCHW), its probabilities against PyTorch's, and its bad input."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import syncseg
from tests.checkpoints import SIX_BANDS as SIX_BAND_DATA
from tests.checkpoints import TINY_MODEL, save_random_checkpoint, unexplained_differences

ort = pytest.importorskip("onnxruntime")

TEXTURES = Path(__file__).resolve().parents[2] / "benchmarks" / "textures"
BASE = [*TINY_MODEL, "data.base_size=0"]
SIX_BANDS = [*BASE, *SIX_BAND_DATA]
CLASSES = ["background", "building", "road", "water"]
PLUGIN_KEYS = ("model_type", "class_names", "names", "resolution", "tile_size", "tiles_overlap", "seg_thresh",
               "seg_small_segment", "standardization_mean", "standardization_std")


def _export(checkpoint: Path, *flags: str) -> tuple[int, Path]:
    export = importlib.import_module("syncseg.commands.export")
    output = checkpoint.with_name("model.deepness.onnx")
    return export.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--output", str(output), *flags]), output


def _as_the_plugin_runs_it(path: Path, tile: np.ndarray) -> tuple[np.ndarray, dict]:
    """The plugin's Segmentor: one input (its last two dimensions the tile size), tiles / 255 as float32
    NCHW, the single output read as class confidences; metadata values json-decoded."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (given,), (output,) = session.get_inputs(), session.get_outputs()
    assert len(output.shape) == 4 and output.shape[2] == output.shape[3]  # its output check
    meta = {key: json.loads(value) for key, value in session.get_modelmeta().custom_metadata_map.items()
            if key in PLUGIN_KEYS}  # the plugin json-decodes each of its keys; syncseg's own keys ride along
    batch = np.float32(tile[None].astype(np.float64) * (1.0 / 255.0)).transpose(0, 3, 1, 2)
    return session.run(None, {given.name: batch})[0][0], {"input_shape": given.shape, **meta}


def _texture_tile(size: int) -> np.ndarray:
    photo = np.asarray(Image.open(TEXTURES / "grass.png").convert("RGB"))
    return np.ascontiguousarray(photo[:size, :size])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("deepness") / "best.pt"
    save_random_checkpoint(checkpoint, BASE, CLASSES, seed=7, iteration=3)
    status, output = _export(checkpoint, "--deepness", "--resolution", "30", "--tiles-overlap", "20",
                             "--seg-threshold", "0.4")
    assert status == 0
    return checkpoint, output


def _agrees(probabilities: np.ndarray, logits: torch.Tensor) -> None:
    assert np.abs(probabilities - torch.softmax(logits, 0).numpy()).max() <= 1e-4
    assert unexplained_differences(logits, torch.from_numpy(probabilities.argmax(0)))[1] == 0


def test_the_plugin_reads_its_metadata_and_gets_pytorchs_probabilities_on_a_real_tile(exported):
    checkpoint, path = exported
    tile = _texture_tile(64)
    probabilities, meta = _as_the_plugin_runs_it(path, tile)
    assert meta["input_shape"] == [1, 3, 64, 64]
    assert str(meta["model_type"]).capitalize() == "Segmentor"
    names = sorted(meta["class_names"].items(), key=lambda item: int(item[0]))
    assert [int(key) for key, _ in names] == list(range(len(CLASSES))) and [name for _, name in names] == CLASSES
    assert (meta["tile_size"], meta["tiles_overlap"], meta["resolution"], meta["seg_thresh"]) == (64, 20, 30.0, 0.4)
    assert probabilities.shape == (4, 64, 64) and np.allclose(probabilities.sum(0), 1.0, atol=1e-5)
    _agrees(probabilities, syncseg.load_model(checkpoint).predict_logits(tile))


def test_a_16_bit_six_band_model_gets_its_own_normalization_inside_the_file(tmp_path):
    checkpoint = tmp_path / "best.pt"
    save_random_checkpoint(checkpoint, SIX_BANDS, CLASSES, seed=8, iteration=3)
    status, path = _export(checkpoint, "--deepness", "--size", "48")
    assert status == 0
    tile = np.random.default_rng(2).integers(0, 65536, (48, 48, 6)).astype(np.uint16)
    probabilities, meta = _as_the_plugin_runs_it(path, tile)
    assert meta["input_shape"] == [1, 6, 48, 48] and meta["tiles_overlap"] == 15 and "resolution" not in meta
    _agrees(probabilities, syncseg.load_model(checkpoint).predict_logits(tile))


def test_a_runtime_refuses_a_deepness_file(exported):
    checkpoint, path = exported
    with pytest.raises(ValueError, match=r"is a QGIS Deepness export .* export with --format onnx, without --deepness"):
        syncseg.load_model(checkpoint, runtime="onnxruntime", exported=path)


@pytest.mark.parametrize("flags,message", [
    (["--deepness", "--size", "64,48"], "--size 64,48: the Deepness plugin runs square tiles"),
    (["--deepness", "--tiles-overlap", "100"], "--tiles-overlap 100: expected a percentage of the tile in 0..99"),
    (["--deepness", "--resolution", "0"], "--resolution 0.0: expected the model's centimetres per pixel"),
    (["--deepness", "--int8"], "--deepness writes an fp32 ONNX file"),
    (["--resolution", "30"], "--resolution set the QGIS Deepness plugin's metadata: add --deepness"),
])
def test_bad_deepness_options_are_one_line_and_exit_2_with_nothing_written(tmp_path, flags, message, capsys):
    checkpoint = tmp_path / "best.pt"
    save_random_checkpoint(checkpoint, BASE, CLASSES, seed=7, iteration=3)
    status, output = _export(checkpoint, *flags)
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and message in lines[0], lines
    assert not output.exists() and not checkpoint.with_name("model.onnx").exists()
