"""Loading a checkpoint's model for inference: what eval.py, predict.py and export.py share.

`load_inference_model`: checkpoint -> config (with overrides and CLI flags) -> model with the weights, on a
device, in eval mode. The file is read by syncseg.engine.checkpoint_file, the weights matched strictly by
syncseg.model.weights.load_model_weights.
"""
from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from syncseg.engine.checkpoint_file import load_checkpoint
from syncseg.engine.object_store import local_copy
from syncseg.engine.config import Config, from_dict, inference_config
from syncseg.engine.devices import resolve_channels_last
from syncseg.model.builder import build_model
from syncseg.model.weights import load_model_weights


@dataclass
class InferenceModel:
    """A checkpoint's model ready for inference (eval mode, on `device`) and what describes it."""

    model: nn.Module
    config: Config  # the checkpoint's config with the overrides and flags applied
    classes: list[str]
    iteration: int | None
    path: Path
    device: torch.device
    runtime: str = "torch"  # or the runtime that runs the exported file (syncseg.engine.runtimes)
    # class index -> the training export's numeric label id (COCO category id, YOLO class id; None: none), for
    # predictions written back in the export's format (predict.py --format); None when the data had no ids
    label_ids: list[int | None] | None = None


def load_inference_model(path: str | Path, *, device: torch.device, overrides: list[str] | tuple[str, ...] = (),
                         flags: Mapping[str, Any] | None = None, runtime: Any = None) -> InferenceModel:
    """Load checkpoint `path` (best.pt or last.pt) for evaluation or prediction on `device`.

    The model is rebuilt from the stored config; `overrides` (KEY=VALUE) and `flags` ({"eval.mode":
    ...}, None values ignored) apply on top. Raises FileNotFoundError / ValueError with one line
    naming the file, the key or the mismatching tensor. `runtime` (a syncseg.engine.cli.RuntimeChoice)
    other than torch runs an ONNX export of the checkpoint instead (a RuntimeModel, on the CPU); its config's
    eval.amp is then "off" (the runtime computes in the precision eval.amp chose; PyTorch's parts in fp32).
    """
    source = f"checkpoint '{path}'"
    path = local_copy(path)  # an object-store URL (s3://.../best.pt) is read from its download
    payload = load_checkpoint(path)
    config = inference_config(payload["config"], overrides, source=source, flags=flags)
    classes = [str(name) for name in payload["classes"]]
    # the layout training resolved on this kind of device (from train.amp), so validation numbers reproduce
    channels_last, _ = resolve_channels_last(config.model.channels_last, config.train.amp, device,
                                             config.model.backbone)
    model = build_model(config.model, len(classes), in_channels=config.data.in_channels, channels_last=channels_last)
    load_model_weights(model, payload.pop("model"), checkpoint=path,
                       saved_model_cfg=from_dict(payload["config"], source=source).model, model_cfg=config.model)
    model.to(device).eval()
    iteration = payload.get("iteration")
    runtime_name = "torch" if runtime is None else runtime.runtime
    if runtime_name != "torch":
        from syncseg.engine.runtimes import runtime_model

        model = runtime_model(model, config=config, classes=classes, checkpoint=path, iteration=iteration,
                              choice=runtime, device=device)
        config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, amp="off"))
    label_ids = payload.get("label_ids")
    return InferenceModel(model=model, config=config, classes=classes, iteration=iteration, path=path, device=device,
                          label_ids=None if label_ids is None else [None if i is None else int(i) for i in label_ids],
                          runtime=runtime_name)
