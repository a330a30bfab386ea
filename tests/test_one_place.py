"""Facts the code states in one place: each test fails if a second copy comes back (issue 20's list)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("syncseg", "model", "data", "scripts")


# the sync_batchnorm distribution's own tests, and the build folder `pip install ./model/sync_batchnorm` leaves
NOT_SOURCES = (ROOT / "model/sync_batchnorm/tests", ROOT / "model/sync_batchnorm/build")


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not any(path.is_relative_to(skipped) for skipped in NOT_SOURCES):
                yield path.relative_to(ROOT).as_posix(), path.read_text()
    for name in ("train.py", "eval.py"):
        yield name, (ROOT / name).read_text()


def _files_matching(pattern: str) -> list[str]:
    return sorted(name for name, text in _sources() if re.search(pattern, text))


@pytest.mark.parametrize("pattern,where", [
    # channels_last: the weights in model/builder.py, the input in model/deeplab.py
    (r"memory_format=torch\.channels_last", ["model/builder.py", "model/deeplab.py"]),
    # augmentation seeds itself from the (seeded) torch RNG; nothing else reseeds the pipelines
    (r"\.set_random_seed\(", ["data/transforms.py"]),
    # the unwrap of {"state_dict": ...} / {"model": ...} weight files
    (r"\(\"state_dict\", \"model\"\)", ["model/backbones.py"]),
    # a norm layer standing in for another: the same tensors, mode and hooks
    (r"\.running_mean, \w+\.running_var = ", []),
    (r"_forward_pre_hooks", ["model/sync_batchnorm/conversion.py"]),
    # autocast for a precision (the app's); the standalone package only turns it off for its statistics (eager
    # and compiled) and re-enters the caller's in replica threads
    (r"torch\.autocast\(", ["model/sync_batchnorm/batchnorm.py", "model/sync_batchnorm/compiled.py",
                            "model/sync_batchnorm/replicate.py", "syncseg/engine/devices.py"]),
    # normalization of uint8 images (mean / std)
    (r"def normalize_batch\(", ["data/transforms.py"]),
    (r"normalize_batch\(", ["data/transforms.py", "syncseg/engine/inference.py", "syncseg/engine/precise_bn.py",
                             "syncseg/engine/trainer.py"]),
    # the training payload is written by training_state.training_payload only
    (r"\"scheduler\": ", ["syncseg/engine/training_state.py"]),
    # the checkpoint file format reads and writes files; model cannot import the engine, so backbone weights
    (r"torch\.(save|load)\(", ["model/backbones.py", "syncseg/engine/checkpoint_file.py"]),
    # a state dict is matched to a model, and its problems worded, in one module
    (r"state_dict_problems\(", ["model/weights.py"]),
])
def test_stated_once(pattern, where):
    assert _files_matching(pattern) == where


def test_the_confusion_matrix_has_no_ignore_label_of_its_own():
    from syncseg.engine.confusion import ConfusionMatrix

    assert inspect.signature(ConfusionMatrix).parameters["ignore_index"].default is inspect.Parameter.empty


def test_loss_and_inference_settings_have_no_defaults_of_their_own():
    """Their defaults are the schema's (TrainConfig / EvalConfig): build_loss and eval_settings pass them."""
    from syncseg.engine.inference import predict
    from syncseg.engine.loss import SegmentationLoss

    loss = inspect.signature(SegmentationLoss).parameters
    assert all(loss[name].default is inspect.Parameter.empty
               for name in ("ohem", "ohem_thresh", "ohem_min_kept", "aux_weight", "class_weights"))
    inference = inspect.signature(predict).parameters
    assert all(inference[name].default is inspect.Parameter.empty
               for name in ("mode", "window_size", "stride", "scales", "flip", "window_batch"))


def test_the_ohem_accumulate_rule_is_the_schemas():
    assert _files_matching(r"train\.ohem with train\.accumulate") == ["syncseg/engine/config/schema.py"]
