"""Export a trained model for deployment (ONNX, TorchScript, torch.export) or release (safetensors),
and check the result against PyTorch.

The exported module takes normalized float32 images N x data.in_channels x H x W
(syncseg.data.transforms.normalize_batch: x / data.max_value, then (x - data.mean) / data.std of the checkpoint's
config; the files carry the channel count, max_value, mean, std and the class names as metadata) and returns
the logits N x C x H x W, a tensor (the model's own forward returns a dict). SynchronizedBatchNorm layers are
reverted to nn.BatchNorm2d first (in eval mode the two compute the same), the auxiliary head is dropped
(training only) and the channels-last conversion is left out (a layout choice of the running framework, not of
the file).

Dynamic sizes: `onnx` (torch.onnx.export with dynamo=True) and `exported` (torch.export.export) take
any batch, height and width the architecture allows (the minimum side, e.g. 17 px at output stride 16,
is reported); `torchscript` is traced (torch.jit.trace, deprecated by PyTorch but still what C++
deployments load), which records the shape arithmetic, so it too runs at other sizes: the check runs
every format at a second size to prove it.
"""
from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from syncseg.engine.atomic import write_atomically
from syncseg.engine.checkpoint_file import SAFETENSORS_SUFFIX
from syncseg.model.sync_batchnorm import revert_model

logger = logging.getLogger(__name__)

# the default file name's ending; safetensors' is required (syncseg.engine.checkpoint_file.is_safetensors_name), the others'
# are not: the loaders are told the format (load_runner), not the name
SUFFIXES = {"onnx": ".onnx", "torchscript": ".torchscript.pt", "exported": ".pt2", "safetensors": SAFETENSORS_SUFFIX}
INPUT_NAME, OUTPUT_NAME = "images", "logits"
METADATA_FILE = "syncseg.json"  # TorchScript / torch.export extra file holding the metadata
TOLERANCE = 1e-4  # allowed max |exported - PyTorch|, relative to the logits' largest magnitude (at least 1)
# pinned in requirements-test.txt; the error says so when they are missing
ONNX_PACKAGES = "onnx==1.23.2 onnxscript==0.7.2"
ONNXRUNTIME_PACKAGE = "onnxruntime==1.32.0"


class MissingRuntimeError(RuntimeError):
    """The runtime that would execute the exported file (onnxruntime) is not installed."""


class LogitsModel(nn.Module):
    """A DeepLab whose forward returns the logits tensor (`out`) instead of a dict."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)["out"]


def export_ready(model: nn.Module) -> LogitsModel:
    """`model` (a DeepLab, modified in place) with plain BatchNorm, no aux head, contiguous input,
    returning logits, in eval mode on the CPU."""
    model = revert_model(model)
    if getattr(model, "aux_classifier", None) is not None:
        model.aux_classifier = None
    if hasattr(model, "channels_last"):
        model.channels_last = False
    return LogitsModel(model.to(memory_format=torch.contiguous_format)).cpu().eval()


def sample_inputs(height: int, width: int, *, channels: int, seed: int = 0) -> list[torch.Tensor]:
    """Random normalized inputs of `channels` channels (data.in_channels): the export sample (batch 2 at
    height x width: torch.export would fix a batch of 1 as a constant) and a check at batch 1 and another
    size, for the dynamic dimensions."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, channels, height, width, generator=generator),
            torch.randn(1, channels, height - height // 4, width + width // 4, generator=generator)]


def _dynamic_shapes() -> dict[str, dict[int, Any]]:
    from torch.export import Dim

    return {INPUT_NAME: {0: Dim("batch", min=1), 2: Dim.DYNAMIC, 3: Dim.DYNAMIC}}


def _quiet_trace(module: nn.Module, sample: torch.Tensor) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():  # deprecation and "converting a tensor to a Python int" notes
        warnings.simplefilter("ignore")
        return torch.jit.trace(module, sample, check_trace=False)


def _dimension_ranges(program: Any) -> str:
    """'batch >= 1, height >= 17, width >= 17' from a torch.export program's range constraints."""
    user_input = program.graph_signature.user_inputs[0]  # parameters and buffers are placeholders too
    placeholder = next(node for node in program.graph.nodes if node.op == "placeholder" and node.name == user_input)
    ranges = {str(symbol): value for symbol, value in program.range_constraints.items()}
    parts = []
    for name, size in zip(("batch", "channels", "height", "width"), placeholder.meta["val"].shape):
        bound = ranges.get(str(size))
        if bound is not None:
            upper = "" if str(bound.upper) in ("int_oo", "oo") else f"..{bound.upper}"
            parts.append(f"{name} {bound.lower}{upper}" if upper else f"{name} >= {bound.lower}")
    return ", ".join(parts) or "static"


def export_model(module: LogitsModel, fmt: str, path: Path, *, sample: torch.Tensor,
                 metadata: Mapping[str, Any], dynamic: bool = True) -> str:
    """Write `module` in format `fmt` (onnx | torchscript | exported) to `path`; returns a line on its
    dynamic dimensions (`dynamic` False: ONNX with the sample's shape fixed, as the Deepness plugin needs).
    The file is written atomically (syncseg.engine.atomic.write_atomically: an export already at `path` stays
    whole when this fails, and a full disk is an OSError naming the file).
    Raises ValueError when the exporter (or its packages) fails."""
    text = json.dumps(dict(metadata))
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit's deprecation notice
            traced = _quiet_trace(module, sample)
            write_atomically(path, lambda file: torch.jit.save(traced, file, _extra_files={METADATA_FILE: text}),
                             what="export")
        return "traced: batch, height and width follow the input"
    if fmt == "exported":
        program = torch.export.export(module, (sample,), dynamic_shapes=_dynamic_shapes())
        write_atomically(path, lambda file: torch.export.save(program, file, extra_files={METADATA_FILE: text}),
                         what="export")
        return _dimension_ranges(program)
    if fmt == "onnx":
        try:
            import onnx  # noqa: F401  (the dynamo exporter needs onnx and onnxscript)
            import onnxscript  # noqa: F401
        except ImportError as error:
            raise ValueError(f"--format onnx needs {ONNX_PACKAGES} ({error.name} is missing; both are pinned "
                             "in requirements-test.txt)") from None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(module, (sample,), None, dynamo=True,
                                        dynamic_shapes=_dynamic_shapes() if dynamic else None,
                                        input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], verbose=False)
        model_proto = program.model_proto
        for key, value in metadata.items():
            entry = model_proto.metadata_props.add()
            entry.key, entry.value = key, value if isinstance(value, str) else json.dumps(value)
        write_atomically(path, lambda file: onnx.save(model_proto, file), what="export")
        dims = model_proto.graph.input[0].type.tensor_type.shape.dim
        return ", ".join(f"{name} {'dynamic' if dim.dim_param else dim.dim_value}"
                         for name, dim in zip(("batch", "channels", "height", "width"), dims))
    raise ValueError(f"export_model: format {fmt!r} is not one of onnx, torchscript, exported (safetensors files "
                     "are written by syncseg.engine.checkpoint_file.save_safetensors)")


def load_runner(fmt: str, path: Path) -> Callable[[torch.Tensor], np.ndarray]:
    """A function running the exported file on a CPU tensor, returning float32 logits as numpy.
    Raises MissingRuntimeError for onnx without onnxruntime."""
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit's deprecation notice
            loaded = torch.jit.load(str(path), map_location="cpu")
    elif fmt == "exported":
        loaded = torch.export.load(str(path)).module()
    elif fmt == "onnx":
        try:
            import onnxruntime
        except ImportError:
            raise MissingRuntimeError(
                f"onnxruntime is not installed, so '{path}' was written but not checked against PyTorch "
                f"(pip install {ONNXRUNTIME_PACKAGE} to check it; it is pinned in requirements-test.txt)") from None
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return lambda images: session.run([OUTPUT_NAME], {INPUT_NAME: images.numpy()})[0]
    else:
        raise ValueError(f"no runner for format {fmt!r}")

    def run(images: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return loaded(images).float().numpy()

    return run


@dataclass
class CheckResult:
    """How the exported file compares with PyTorch on each input."""

    shapes: list[tuple[int, ...]]
    max_abs_diff: float
    logits_scale: float  # largest |logit| of PyTorch, the scale the tolerance is relative to
    argmax_agreement: float  # fraction of pixels with the same predicted class

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= TOLERANCE * max(1.0, self.logits_scale)

    def describe(self) -> str:
        shapes = ", ".join("x".join(map(str, shape)) for shape in self.shapes)
        return (f"max |difference| {self.max_abs_diff:.2e} (logits up to {self.logits_scale:.3g}; tolerance "
                f"{TOLERANCE:g} x max(1, that)), same class at {100 * self.argmax_agreement:.3f}% of the "
                f"pixels, on inputs {shapes}")


def check_against_pytorch(module: nn.Module, run: Callable[[torch.Tensor], np.ndarray],
                          inputs: Sequence[torch.Tensor]) -> CheckResult:
    """Compare `run` (an exported file's runner) with `module` on each input."""
    worst, scale, same, total = 0.0, 0.0, 0, 0
    for images in inputs:
        with torch.no_grad():
            reference = module(images).float().numpy()
        output = np.asarray(run(images), dtype=np.float32)
        if output.shape != reference.shape:
            raise ValueError(f"the exported model returned shape {output.shape} for input {tuple(images.shape)}, "
                             f"PyTorch {reference.shape}")
        worst = max(worst, float(np.abs(output - reference).max()))
        scale = max(scale, float(np.abs(reference).max()))
        same += int((output.argmax(1) == reference.argmax(1)).sum())
        total += reference.shape[0] * reference.shape[2] * reference.shape[3]
    return CheckResult(shapes=[tuple(images.shape) for images in inputs], max_abs_diff=worst, logits_scale=scale,
                       argmax_agreement=same / max(1, total))


def export_metadata(*, classes: Sequence[str], config: Any, checkpoint: Path, iteration: Any,
                    checkpoint_sha256: str | None = None) -> dict[str, Any]:
    """What a deployment needs to feed the model and read its output; `checkpoint_sha256` (the checkpoint file's
    sha256) lets `--runtime` tell an export of this checkpoint from another's (syncseg.engine.runtimes)."""
    data = config.data
    order = "RGB" if data.in_channels == 3 else "the files' channel order (RGB(A) first in colour files)"
    return {
        "producer": "syncseg",
        "input": f"{INPUT_NAME}: float32 N x {data.in_channels} x H x W, {order}, x / max_value then (x - mean) / std",
        "in_channels": data.in_channels,
        "max_value": data.max_value,
        "output": f"{OUTPUT_NAME}: float32 N x C x H x W, argmax over C is the class index",
        "mean": list(config.data.mean),
        "std": list(config.data.std),
        "classes": list(classes),
        "checkpoint": str(checkpoint),
        "iteration": iteration,
        "arch": f"{config.model.arch}/{config.model.backbone}/os{config.model.output_stride}",
        **({"checkpoint_sha256": checkpoint_sha256} if checkpoint_sha256 else {}),
    }
