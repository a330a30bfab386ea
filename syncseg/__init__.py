"""syncseg: DeepLabV3 / V3+ semantic segmentation with synchronized BatchNorm.

The Python API (syncseg/api.py), importable from here:

    build_model(arch=..., backbone=..., num_classes=..., norm="syncbn", ...)  a DeepLab nn.Module
    load_config(name_or_path, overrides)   a validated Config (a shipped config's name or a YAML path)
    train(config, overrides, ...)          train in this process; returns the run's result and run dir
    load_model(checkpoint, device=...)     a Predictor: .predict(image) -> H x W class indices
    predict(predictor, image)              the same as predictor.predict(image)
    demo_image()                           an image of the demo's synthetic shapes

Importing syncseg imports nothing else: each name loads its module on first use, so `import syncseg` is
instant and `syncseg.load_config` does not import torch. Its one effect: in a checkout that is not installed,
`syncseg.model` and `syncseg.data` are found in the checkout's top-level folders (syncseg/layout.py).
"""
from __future__ import annotations

import importlib
from typing import Any

from syncseg.layout import install_checkout_finder

install_checkout_finder()

_PUBLIC = {
    "build_model": "syncseg.api", "train": "syncseg.api", "load_model": "syncseg.api", "predict": "syncseg.api",
    "demo_image": "syncseg.api", "Predictor": "syncseg.api",
    "load_config": "syncseg.engine.config", "Config": "syncseg.engine.config",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'syncseg' has no attribute '{name}'")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
