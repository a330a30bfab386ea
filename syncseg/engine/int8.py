"""int8 post-training quantization of an ONNX export, calibrated on the run's own training images, and the
validation mIoU it costs.

`calibration_inputs` runs syncseg.engine.inference.predict_batch over N training images (evenly spaced
through the config's data.train_split, read as validation reads images: no augmentation) with a model that
records what it is given: the calibration sees exactly the tensors inference feeds the network (the
normalization, data.base_size, whole or slide windows, scales and flips of the eval section).
`quantize_onnx` is ONNX Runtime's static quantization in QDQ form (int8 weights per output channel, uint8
activations, ranges from the calibration by `method`); the QDQ file runs in int8 in ONNX Runtime and in
OpenVINO alike. `compare_miou` evaluates the fp32 and the int8 file on the validation split in ONNX
Runtime, as eval.py --runtime onnxruntime would.

The calibration methods' mIoU on the demo model: docs/evaluation.md, "Runtimes" (benchmarks/bench_runtimes.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from syncseg.engine.runtimes import require_runtime

logger = logging.getLogger(__name__)

CALIBRATION_METHODS = ("percentile", "minmax", "entropy")
DEFAULT_MAX_DROP = 1.0  # mIoU points the int8 file may lose against the fp32 one


class _Recorder(nn.Module):
    """Keeps every batch it is given (as float32 numpy) and returns zero logits of the right shape."""

    def __init__(self, num_classes: int, limit: int) -> None:
        super().__init__()
        self.num_classes, self.limit, self.inputs = num_classes, limit, []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        for single in images.split(1):
            if len(self.inputs) < self.limit:
                self.inputs.append(single.float().numpy().copy())
        return images.new_zeros((images.shape[0], self.num_classes, *images.shape[-2:]), dtype=torch.float32)


def calibration_inputs(config: Any, num_classes: int, count: int, *, limit: int = 0) -> list[np.ndarray]:
    """The network inputs (1 x C x H x W float32 each) of `count` training images predicted as inference does;
    at most `limit` (0: all of them: several per image with slide mode, scales or flip). ValueError naming the
    split and its size when it holds fewer than `count` images."""
    from syncseg.data import build_dataset
    from syncseg.engine.inference import predict_batch

    if count < 1:
        raise ValueError(f"--calibrate {count}: expected a positive number of training images")
    split = config.data.train_split
    dataset = build_dataset(config.data, split, train=False)
    if len(dataset) < count:
        raise ValueError(f"--calibrate {count}: data.train_split '{split}' of data.dataset={config.data.dataset} has "
                         f"only {len(dataset)} images; calibrate on at most {len(dataset)}")
    recorder = _Recorder(num_classes, limit if limit > 0 else 1 << 30)
    eval_cfg = dataclasses.replace(config.eval, amp="off")
    for index in np.linspace(0, len(dataset) - 1, count).round().astype(int):
        image, _ = dataset[int(index)]
        with torch.inference_mode():
            predict_batch(recorder, image[None], num_classes=num_classes, data_cfg=config.data, eval_cfg=eval_cfg,
                          long_side=config.data.base_size)
    return recorder.inputs


def quantize_onnx(fp32_path: Path, int8_path: Path, inputs: list[np.ndarray], *, method: str = "percentile") -> None:
    """Write the int8 QDQ quantization of `fp32_path` to `int8_path` (atomically), calibrated on `inputs`;
    the fp32 file's metadata is kept, with precision=int8 and the calibration's size and method added."""
    require_runtime("onnxruntime")
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from syncseg.engine.export_formats import INPUT_NAME

    if method not in CALIBRATION_METHODS:
        raise ValueError(f"--calibration-method {method!r}: expected one of {', '.join(CALIBRATION_METHODS)}")

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._items = iter(inputs)

        def get_next(self) -> dict[str, np.ndarray] | None:
            item = next(self._items, None)
            return None if item is None else {INPUT_NAME: item}

    calibrate = {"percentile": CalibrationMethod.Percentile, "minmax": CalibrationMethod.MinMax,
                 "entropy": CalibrationMethod.Entropy}[method]
    extra = {"CalibPercentile": 99.999} if method == "percentile" else {}
    int8_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".int8-", dir=int8_path.parent) as folder:
        prepared, quantized = Path(folder) / "prepared.onnx", Path(folder) / "int8.onnx"
        # shape inference and graph clean-up before quantization (the symbolic pass cannot follow the dynamic sizes)
        quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
        with contextlib.redirect_stdout(io.StringIO()):  # the calibrators print their histogram settings
            quantize_static(str(prepared), str(quantized), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=calibrate, extra_options=extra)
        source, model = onnx.load(str(fp32_path)), onnx.load(str(quantized))
        del model.metadata_props[:]
        added = {"precision": "int8", "calibration_images": str(len(inputs)), "calibration_method": method}
        for entry in source.metadata_props:
            if entry.key not in added:
                model.metadata_props.add(key=entry.key, value=entry.value)
        for key, value in added.items():
            model.metadata_props.add(key=key, value=value)
        onnx.save(model, str(quantized))
        os.replace(quantized, int8_path)


@dataclass
class Comparison:
    """Validation mIoU (0..1) of the fp32 and the int8 file, on the same images."""

    fp32_miou: float
    int8_miou: float
    num_images: int

    @property
    def drop_points(self) -> float:
        return 100.0 * (self.fp32_miou - self.int8_miou)

    def describe(self) -> str:
        return (f"validation mIoU fp32 {100 * self.fp32_miou:.2f}, int8 {100 * self.int8_miou:.2f} (drop "
                f"{self.drop_points:.2f} points, {self.num_images} images)")


def compare_miou(config: Any, classes: list[str], fp32_path: Path, int8_path: Path, *, threads: int = 0) -> Comparison:
    """Evaluate both files in ONNX Runtime on data.val_split (the eval section's protocol, amp off)."""
    from syncseg.data import build_dataset
    from syncseg.engine.evaluate import evaluate
    from syncseg.engine.runtimes import open_runtime
    from syncseg.engine.samplers import build_eval_loader

    dataset = build_dataset(config.data, config.data.val_split, train=False, compact_masks=True)
    loader = build_eval_loader(dataset, batch_size=config.eval.batch_size, num_workers=0, pin_memory=False)
    eval_cfg = dataclasses.replace(config.eval, amp="off")
    results = []
    for path in (fp32_path, int8_path):
        model = open_runtime("onnxruntime", path, precision="fp32", threads=threads)
        metrics = evaluate(model, loader, num_classes=len(classes), device="cpu", data_cfg=config.data,
                           eval_cfg=eval_cfg, progress=False)
        results.append(metrics)
    return Comparison(fp32_miou=float(results[0]["miou"]), int8_miou=float(results[1]["miou"]),
                      num_images=int(results[0]["num_images"]))
