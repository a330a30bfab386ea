"""syncseg.engine.export_formats: every format round-trips within 1e-4 of PyTorch, at the export size and another one."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from syncseg.engine.config import load_config
from syncseg.engine.export_formats import (
    TOLERANCE,
    LogitsModel,
    MissingRuntimeError,
    check_against_pytorch,
    export_model,
    export_ready,
    load_runner,
    sample_inputs,
)
from syncseg.model.builder import build_model
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

TINY = ["model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1,2,3", "model.aux_loss=true",
        "model.channels_last=true"]


@pytest.fixture(scope="module")
def tiny_module():
    config = load_config(None, TINY)
    torch.manual_seed(0)
    model = build_model(config.model, 5)
    assert any(isinstance(m, SynchronizedBatchNorm2d) for m in model.modules())
    with torch.no_grad():  # non-trivial statistics, so a BN mistake shows
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
    reference = model.eval()
    inputs = sample_inputs(32, 40, channels=3)
    with torch.no_grad():
        expected = [reference(images)["out"].clone() for images in inputs]
    return export_ready(reference), inputs, expected


def test_export_ready_returns_logits_with_plain_batch_norm(tiny_module):
    module, inputs, expected = tiny_module
    assert isinstance(module, LogitsModel) and not module.training
    assert not any(isinstance(m, SynchronizedBatchNorm2d) for m in module.modules())
    assert module.model.aux_classifier is None
    with torch.no_grad():
        for images, logits in zip(inputs, expected):
            assert torch.allclose(module(images), logits, atol=1e-6)  # same function, tensor out
    assert [tuple(x.shape) for x in inputs] == [(2, 3, 32, 40), (1, 3, 24, 50)]  # batch and size both change


@pytest.mark.parametrize("fmt", [pytest.param("onnx", marks=pytest.mark.slow), pytest.param("exported", marks=pytest.mark.slow),
                                 "torchscript"])
def test_round_trip_within_tolerance_at_two_sizes(tiny_module, fmt, tmp_path):
    module, inputs, expected = tiny_module
    path = tmp_path / f"model.{fmt}"
    dynamic = export_model(module, fmt, path, sample=inputs[0], metadata={"classes": ["a", "b", "c", "d", "e"]})
    run = load_runner(fmt, path)
    for images, logits in zip(inputs, expected):
        output = torch.from_numpy(run(images))
        assert output.shape == logits.shape
        assert (output - logits).abs().max().item() <= 1e-4
    result = check_against_pytorch(module, run, inputs)
    assert result.passed and result.argmax_agreement == 1.0 and result.max_abs_diff <= TOLERANCE
    if fmt == "onnx":
        import onnx

        proto = onnx.load(str(path))
        assert json.loads({p.key: p.value for p in proto.metadata_props}["classes"])[4] == "e"
        assert [d.dim_param != "" for d in proto.graph.input[0].type.tensor_type.shape.dim] == [True, False, True, True]
        assert [i.name for i in proto.graph.input] == ["images"] and proto.graph.output[0].name == "logits"
    if fmt == "exported":
        assert dynamic.startswith("batch >= 1, height >= ") and "width >= " in dynamic


def test_a_wrong_export_fails_the_check(tiny_module):
    module, inputs, _ = tiny_module
    result = check_against_pytorch(module, lambda images: module(images).detach().numpy() + 1e-2, inputs)
    assert not result.passed and "max |difference| 1.00e-02" in result.describe()


def test_onnx_without_onnxruntime_is_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    with pytest.raises(MissingRuntimeError, match=r"onnxruntime is not installed.*written but not checked.*pip install"):
        load_runner("onnx", tmp_path / "m.onnx")
