"""build_model settings, parameter groups, fine-tuning loads, channels_last, export."""
import gc
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
import torchvision
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from syncseg.engine.config import ModelConfig
from syncseg.engine.optim import build_param_groups
from syncseg.model.builder import build_model, unwrap_model
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d, revert_model
from syncseg.model.weights import load_segmentation_weights

ROOT = Path(__file__).resolve().parents[2]


def small(**settings) -> ModelConfig:
    values = dict(arch="deeplabv3plus", backbone="resnet18", output_stride=16, head_channels=32)
    values.update(settings)
    return ModelConfig(**values)


def _norms(module: nn.Module) -> list[type]:
    kinds = (nn.modules.batchnorm._BatchNorm, FrozenBatchNorm2d)
    return [type(m) for m in module.modules() if isinstance(m, kinds)]


@pytest.mark.parametrize("arch", ["deeplabv3", "deeplabv3plus"])
def test_norm_choice(arch):
    synced = build_model(small(arch=arch, aux_loss=True, norm="syncbn"), 4)
    assert set(_norms(synced)) == {SynchronizedBatchNorm2d}
    plain = build_model(small(arch=arch, aux_loss=True, norm="bn"), 4)
    assert set(_norms(plain)) == {nn.BatchNorm2d}
    frozen = build_model(small(arch=arch, aux_loss=True, norm="frozen_bn", backbone="mobilenet_v3_large"), 4)
    assert set(_norms(frozen.backbone)) == {FrozenBatchNorm2d}
    assert set(_norms(frozen.classifier)) | set(_norms(frozen.aux_classifier)) == {SynchronizedBatchNorm2d}
    frozen_layers = [m for m in frozen.backbone.modules() if isinstance(m, FrozenBatchNorm2d)]
    assert all(not t.requires_grad for m in frozen_layers for t in m.state_dict().values())
    assert frozen_layers[0].eps == 0.001  # MobileNetV3's BatchNorm setting survives the norm choice


def test_frozen_bn_backbone_takes_imagenet_statistics(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    folder = tmp_path / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    classifier = torchvision.models.resnet18(weights=None)
    with torch.no_grad():
        classifier.bn1.running_mean.uniform_(-1, 1)
        classifier.bn1.weight.uniform_(0.5, 2)
    torch.save(classifier.state_dict(), folder / os.path.basename(urlparse(weights.url).path))
    model = build_model(small(norm="frozen_bn", pretrained_backbone="imagenet"), 3)
    assert torch.equal(model.backbone.bn1.running_mean, classifier.bn1.running_mean)
    assert torch.equal(model.backbone.bn1.weight, classifier.bn1.weight)
    assert torch.equal(model.backbone.layer4[1].conv2.weight, classifier.layer4[1].conv2.weight)


def test_param_groups_split_backbone_and_head():
    model = build_model(small(aux_loss=True), 4)
    groups = build_param_groups(nn.DataParallel(model), lr=0.01, head_lr_mult=10.0, weight_decay=1e-4)
    assert [g["name"] for g in groups] == ["backbone", "head"]
    by_name = {g["name"]: g for g in groups}
    assert by_name["backbone"]["lr"] == pytest.approx(0.01) and by_name["head"]["lr"] == pytest.approx(0.1)
    assert all(g["weight_decay"] == 1e-4 for g in groups)
    backbone_ids = {id(p) for p in by_name["backbone"]["params"]}
    head_ids = {id(p) for p in by_name["head"]["params"]}
    assert backbone_ids == {id(p) for p in model.backbone.parameters()}
    assert not backbone_ids & head_ids
    assert backbone_ids | head_ids == {id(p) for p in model.parameters()}
    torch.optim.SGD(groups, lr=0.01, momentum=0.9)  # accepted as is


def test_param_groups_leave_out_frozen_parameters():
    model = build_model(small(), 4)
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    groups = build_param_groups(model, lr=0.1, head_lr_mult=1.0, weight_decay=0.0)
    assert [g["name"] for g in groups] == ["head"]


def _logits_keys(aux: bool) -> list[str]:
    keys = ["classifier.to_logits.weight", "classifier.to_logits.bias"]
    if aux:
        keys += ["aux_classifier.4.weight", "aux_classifier.4.bias"]
    return sorted(keys)


def test_fine_tuning_with_a_different_class_count_skips_only_the_classifiers():
    torch.manual_seed(0)
    source = build_model(small(aux_loss=True), 21).state_dict()
    model = build_model(small(aux_loss=True), 6)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    report = load_segmentation_weights(model, source)
    assert sorted(report.skipped) == _logits_keys(aux=True) and report.missing == []
    assert set(report.skipped.values()) == {"21 classes in the file, 6 in the model"}
    assert sorted(report.loaded) == sorted(set(source) - set(report.skipped))
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh[key] if key in report.skipped else source[key]), key
    # the same class count loads everything
    report = load_segmentation_weights(build_model(small(aux_loss=True), 21), source)
    assert report.skipped == {} and report.missing == [] and report.loaded == list(source)


@pytest.mark.slow
def test_fine_tuning_from_torchvision_deeplabv3_resnet50():
    reference = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None,
                                                                    num_classes=21, aux_loss=True)
    model = build_model(ModelConfig(arch="deeplabv3", backbone="resnet50", aux_loss=True), 6)
    report = load_segmentation_weights(model, reference.state_dict())
    assert sorted(report.skipped) == ["aux_classifier.4.bias", "aux_classifier.4.weight", "classifier.4.bias",
                                      "classifier.4.weight"]
    assert torch.equal(model.classifier[0].convs[4][1].weight, reference.classifier[0].convs[4][1].weight)
    assert "classifier.4.* (21 classes in the file, 6 in the model)" in report.summary()


def test_aux_weights_are_skipped_without_an_aux_head_and_a_missing_aux_head_stays_fresh():
    """torchvision's COCO weights carry an aux classifier; a model without one must still load them."""
    torch.manual_seed(0)
    with_aux = build_model(small(aux_loss=True), 4).state_dict()
    model = build_model(small(), 4)
    report = load_segmentation_weights(model, with_aux)
    aux_keys = [key for key in with_aux if key.startswith("aux_classifier.")]
    assert sorted(report.skipped) == sorted(aux_keys) and report.missing == []
    assert all(torch.equal(value, with_aux[key]) for key, value in model.state_dict().items())
    assert "aux_classifier.* (the model has no aux classifier: model.aux_loss=false)" in report.summary()

    model = build_model(small(aux_loss=True), 4)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    without_aux = {key: value for key, value in with_aux.items() if key not in aux_keys}
    report = load_segmentation_weights(model, without_aux)
    assert report.skipped == {} and sorted(report.missing) == sorted(aux_keys)
    assert all(torch.equal(model.state_dict()[key], fresh[key]) for key in aux_keys)
    assert "not in the file (kept freshly initialized): aux_classifier.*" in report.summary()


def test_fine_tuning_rejects_other_architectures_in_one_line_before_loading_anything():
    source = build_model(small(aux_loss=True), 21).state_dict()
    cases = [
        (small(backbone="resnet34", aux_loss=True), "missing tensor(s) (e.g. backbone.layer1.2.conv1.weight)"),
        (small(head_channels=16, aux_loss=True), "shape mismatch(es) outside the classifier"),
        (small(arch="deeplabv3", aux_loss=True), "unexpected tensor(s) (e.g. classifier.aspp.convs.0.0.weight)"),
    ]
    for config, message in cases:
        model = build_model(config, 21)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError) as error:
            load_segmentation_weights(model, source)
        assert message in str(error.value) and "\n" not in str(error.value)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing half-loaded
    backbone_only = {key[len("backbone."):]: value for key, value in source.items() if key.startswith("backbone.")}
    with pytest.raises(ValueError, match="looks like backbone .classification. weights: give it as "
                                         "model.pretrained_backbone"):
        load_segmentation_weights(build_model(small(), 21), backbone_only)


def test_fine_tuning_strips_a_data_parallel_prefix():
    source = build_model(small(), 4).state_dict()
    model = build_model(small(), 4)
    report = load_segmentation_weights(model, {f"module.{k}": v for k, v in source.items()})
    assert report.loaded == list(source) and report.skipped == {}
    assert torch.equal(model.state_dict()["classifier.to_logits.weight"], source["classifier.to_logits.weight"])


def test_compact_keys_names_whole_modules_and_single_keys_exactly():
    from syncseg.model.weights import compact_keys

    universe = ["a.x", "a.y", "b.0.w", "b.0.b", "b.1.w", "c"]
    assert compact_keys(universe, universe) == ["a.*", "b.*", "c"]
    assert compact_keys(["a.x", "b.0.w", "b.0.b", "c"], universe) == ["a.x", "b.0.*", "c"]
    assert compact_keys([], universe) == []


@pytest.mark.parametrize("arch", ["deeplabv3", "deeplabv3plus"])
def test_channels_last_end_to_end(arch):
    torch.manual_seed(0)
    reference = build_model(small(arch=arch, aux_loss=True), 4)
    model = build_model(small(arch=arch, aux_loss=True, channels_last=True), 4)
    model.load_state_dict(reference.state_dict())
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    x = torch.randn(2, 3, 45, 39)
    for mode in (False, True):
        reference.train(mode)
        model.train(mode)
        for m in list(model.modules()) + list(reference.modules()):
            if isinstance(m, nn.Dropout):
                m.eval()
        expected, actual = reference(x), model(x)
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], atol=1e-4, rtol=1e-4)
    (actual["out"].mean() + actual["aux"].mean()).backward()
    (expected["out"].mean() + expected["aux"].mean()).backward()
    reference_grads = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, reference_grads[name].grad, atol=1e-4, rtol=1e-3)


def test_export_with_revert_model_and_jit_trace():
    torch.manual_seed(0)
    model = build_model(small(aux_loss=True), 4).eval()
    x = torch.randn(1, 3, 65, 65)
    with torch.no_grad():
        expected = model(x)
    exported = revert_model(model)
    assert SynchronizedBatchNorm2d not in set(_norms(exported))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit deprecation and tracer notes
        traced = torch.jit.trace(exported, x, strict=False)
        torch.jit.save(traced, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
    with torch.no_grad():
        actual = loaded(x)
    for key in ("out", "aux"):
        torch.testing.assert_close(actual[key], expected[key], atol=1e-5, rtol=1e-5)


def test_invalid_class_count():
    with pytest.raises(ValueError, match="num_classes"):
        build_model(small(), 0)


def test_importing_the_package_is_light():
    # syncseg.model.sync_batchnorm stands alone: importing it loads torch only, not the networks or torchvision
    code = ("import sys, syncseg.model.sync_batchnorm; "
            "assert 'syncseg.model.builder' not in sys.modules and 'torchvision' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("source_norm,target_norm", [("syncbn", "frozen_bn"), ("frozen_bn", "syncbn"), ("bn", "syncbn")])
def test_checkpoints_load_across_norm_choices(source_norm, target_norm):
    """Same state-dict keys whatever the norm (FrozenBatchNorm2d just has no num_batches_tracked)."""
    torch.manual_seed(0)
    source = build_model(small(norm=source_norm), 4)
    with torch.no_grad():
        source.backbone.bn1.running_mean.uniform_(-1, 1)
    target = build_model(small(norm=target_norm), 4)
    report = load_segmentation_weights(target, source.state_dict())
    counters = {key for key in source.state_dict() if key.endswith("num_batches_tracked")}
    # only BatchNorm counters may differ: FrozenBatchNorm2d keeps none (nothing else skipped or missing)
    assert set(report.skipped) | set(report.missing) <= counters | {k for k in target.state_dict()
                                                                      if k.endswith("num_batches_tracked")}
    assert torch.equal(target.backbone.bn1.running_mean, source.backbone.bn1.running_mean)
    x = torch.randn(1, 3, 33, 35)
    with torch.no_grad():
        torch.testing.assert_close(target.eval()(x)["out"], source.eval()(x)["out"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_channels_last_mixed_precision_training_step():
    torch.manual_seed(0)
    model = build_model(small(aux_loss=True, channels_last=True), 4).cuda().train()
    reference = build_model(small(aux_loss=True), 4).train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 65, 63)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        result = model(x.cuda())
    assert result["out"].shape == (2, 4, 65, 63) and torch.isfinite(result["out"].float()).all()
    (result["out"].float().mean() + result["aux"].float().mean()).backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    reference.load_state_dict(model.state_dict())  # running statistics after the step
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # full fp32 convs
        torch.testing.assert_close(model(x.cuda())["out"].cpu(), reference.eval()(x)["out"], atol=1e-3, rtol=1e-3)


def test_unwrap_model_strips_wrappers(tmp_path):
    inner = nn.Linear(2, 2)
    assert unwrap_model(inner) is inner
    assert unwrap_model(nn.DataParallel(nn.DataParallel(inner))) is inner
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(inner)
        assert unwrap_model(ddp) is inner
        assert list(unwrap_model(ddp).state_dict()) == ["weight", "bias"]
        del ddp
        gc.collect()  # DDP sits in reference cycles: a live DDP during destroy_process_group can abort gloo at exit
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["deeplabv3", "deeplabv3plus"])
def test_aspp_dropout_follows_the_config_and_keeps_the_state_dict(arch):
    default = build_model(small(arch=arch), 3)
    without = build_model(small(arch=arch, aspp_dropout=0.0), 3)
    assert [m.p for m in default.classifier.modules() if isinstance(m, nn.Dropout)] == [0.5]
    assert [m.p for m in without.classifier.modules() if isinstance(m, nn.Dropout)] == [0.0]
    assert default.state_dict().keys() == without.state_dict().keys()
