"""syncseg.lazy_registry.Registry and the extension points' registries: one place decides each point's names."""
from __future__ import annotations

import pytest

from syncseg.engine.config import load_config
from syncseg.lazy_registry import Registry, load_object


def _registry() -> Registry:
    registry = Registry("model.backbone")
    registry.register("resnet18", "a")
    registry.register("resnet50", "b")
    registry.register_family("timm:", "c", meaning="a timm encoder")
    return registry


def test_names_families_and_entries():
    registry = _registry()
    assert registry.names() == ("resnet18", "resnet50") and list(registry) == ["resnet18", "resnet50"]
    assert registry.get("resnet50") == "b" and registry.get("timm:convnext_tiny") == "c"
    assert "timm:x" in registry and "timm:" not in registry and "resnet152" not in registry
    assert registry.describe() == "resnet18, resnet50, or timm:<name> (a timm encoder)"


def test_an_unknown_name_lists_the_registered_ones_and_the_closest():
    with pytest.raises(ValueError, match=r"^model.backbone='resnet5' is not one of resnet18, resnet50, or "
                                         r"timm:<name> \(a timm encoder\); did you mean 'resnet50'\?$"):
        _registry().get("resnet5")
    assert _registry().unknown("zzz").endswith("(a timm encoder)")  # nothing close: no guess


def test_a_taken_name_needs_replace_and_unregister_removes_it():
    registry = _registry()
    with pytest.raises(ValueError, match="'resnet18' is already registered; pass replace=True"):
        registry.register("resnet18", "x")
    with pytest.raises(ValueError, match="prefix of a family"):
        registry.register("timm:mine", "x")
    registry.register("resnet18", "x", replace=True)
    assert registry.get("resnet18") == "x"
    registry.unregister("resnet18")
    assert registry.names() == ("resnet50",)


def test_load_object_imports_a_module_attribute_only_when_asked():
    assert load_object("os.path:join") is __import__("os").path.join
    assert load_object(len) is len
    with pytest.raises(ValueError, match="not a 'package.module:attribute' reference"):
        load_object("os.path.join")


@pytest.mark.parametrize("override,message", [
    ("data.dataset=cityscape", "data.dataset='cityscape' is not one of voc, cityscapes, ade20k, synthetic, folder, coco, "
                               "labelme, cvat, yolo_seg, label_studio, cvat_mask, raster; did you mean 'cityscapes'?"),
    ("model.arch=deeplabv3+", "model.arch='deeplabv3+' is not one of deeplabv3, deeplabv3plus; did you mean"),
    ("model.norm=syncbnn", "did you mean 'syncbn'?"),
    ("model.backbone=resnet", "or timm:<name> (a timm encoder); did you mean"),
    ("train.loss=dise", "train.loss names 'dise', which is not one of ce, dice, focal, lovasz; did you mean 'dice'?"),
])
def test_the_config_checks_names_against_the_registries(override, message):
    with pytest.raises(ValueError) as error:
        load_config(None, [override])
    assert message in str(error.value)


def test_export_choices_and_help_are_the_registrys():
    from syncseg.commands.export import build_parser
    from syncseg.engine.registry import EXPORT_FORMATS

    action = next(action for action in build_parser()._actions if action.dest == "format")
    assert tuple(action.choices) == EXPORT_FORMATS.names() == ("onnx", "torchscript", "exported", "safetensors")
    assert all(name in action.help for name in EXPORT_FORMATS.names())
