"""Running an exported ONNX file in ONNX Runtime or OpenVINO behind the nn.Module interface inference uses.

`RuntimeModel` is an nn.Module whose forward hands the normalized float32 batch (N x C x H x W, on the CPU)
to the runtime and returns its logits as a tensor; everything around the network (normalization, resizing
to data.base_size, whole or slide mode, scales, flip, the output stride's upsampling, argmax) stays the
PyTorch code of syncseg.engine.inference, so a runtime's masks differ from PyTorch fp32's only by the
runtime's arithmetic. The file is an export of syncseg.engine.export_formats (dynamic batch, height and
width), either given (`exported=`, e.g. an int8 file of `export --int8`) or written once into a cache
beside the checkpoint (`cached_export`), keyed by the checkpoint's content, the model config and the torch
version; a file whose metadata says it comes from another checkpoint or model is refused.

Precision: eval.amp resolves as for PyTorch (syncseg.engine.devices.resolve_precision). ONNX Runtime's
CPU kernels are fp32 (an int8 file runs its quantized operators in int8): auto runs fp32, and an explicit
bf16 or fp16 is refused. OpenVINO runs bf16 where eval.amp resolves to bf16 (auto on a CPU with
AVX512_BF16/AMX, as PyTorch's auto) and fp32 otherwise, by its INFERENCE_PRECISION_HINT (OpenVINO's own
default would be bf16 on such CPUs even for eval.amp=off). Threads: `threads` > 0 sets the runtime's
intra-op threads (ONNX Runtime) or INFERENCE_NUM_THREADS (OpenVINO); 0 leaves the runtime's own choice
(one thread per physical core in both).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from syncseg.engine.cli import RUNTIMES, RuntimeChoice
from syncseg.engine.devices import resolve_precision

logger = logging.getLogger(__name__)
# pinned in requirements-test.txt; the error names the extra that installs them
EXTRAS = {"onnxruntime": ("onnxruntime", "onnx"), "openvino": ("openvino", "openvino")}
CACHE_FOLDER = ".syncseg-exports"  # beside the checkpoint; else under $XDG_CACHE_HOME/syncseg/exports
CACHE_VERSION = 1  # bump when an export of the same checkpoint would come out different
# metadata of syncseg.engine.export_formats.export_metadata that must equal the checkpoint's
MATCHED_KEYS = ("classes", "in_channels", "arch", "max_value", "mean", "std")


class RuntimeNotInstalled(ValueError):
    """The runtime asked for is not installed (exit 2: the command cannot run as given)."""


def require_runtime(runtime: str) -> Any:
    """The runtime's module; RuntimeNotInstalled naming the pip extra when it is missing."""
    if runtime not in RUNTIMES[1:]:
        raise ValueError(f"--runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    module, extra = EXTRAS[runtime]
    try:
        return __import__(module)
    except ImportError:
        raise RuntimeNotInstalled(f"--runtime {runtime}: the package {module} is not installed (pip install "
                                  f"\"syncseg[{extra}]\")") from None


def runtime_precision(runtime: str, amp: str, device: torch.device) -> tuple[str, str]:
    """(fp32 | bf16, why) that `runtime` computes in for eval.amp=`amp` (see the module docstring)."""
    chosen, why = resolve_precision(amp, device)
    if runtime == "onnxruntime":
        if chosen in ("bf16", "fp16") and amp != "auto":
            raise ValueError(f"eval.amp={amp}: onnxruntime runs fp32 on the CPU (int8 where the file is quantized); "
                             "use eval.amp=off or auto, or --runtime openvino for bf16")
        return "fp32", "onnxruntime's CPU kernels are fp32"
    if chosen == "fp16":
        raise ValueError(f"eval.amp={amp}: openvino on the CPU runs fp32 or bf16, not fp16; use off, auto or bf16")
    return ("bf16" if chosen == "bf16" else "fp32"), why


class RuntimeModel(nn.Module):
    """An exported file run by a runtime: forward(normalized float32 N x C x H x W on the CPU) -> logits."""

    def __init__(self, run: Callable[[np.ndarray], np.ndarray], *, runtime: str, path: Path, precision: str,
                 threads: int) -> None:
        super().__init__()
        self._run = run
        self.runtime, self.path, self.precision, self.threads = runtime, path, precision, threads

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.device.type != "cpu":
            raise ValueError(f"{self.runtime} runs on the CPU; got images on {images.device}")
        array = np.ascontiguousarray(images.detach().float().numpy())
        return torch.from_numpy(np.asarray(self._run(array), dtype=np.float32))

    def describe(self) -> str:
        threads = f"{self.threads} threads" if self.threads > 0 else "its own thread count"
        return f"{self.runtime} ({self.precision}, {threads}) on '{self.path}'"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def onnxruntime_runner(path: Path, *, threads: int = 0) -> Callable[[np.ndarray], np.ndarray]:
    """A function running `path` in an ONNX Runtime CPU session; ValueError naming the file when it does not load."""
    from syncseg.engine.export_formats import INPUT_NAME, OUTPUT_NAME

    ort = require_runtime("onnxruntime")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    if threads > 0:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail, ...)
        raise ValueError(f"'{path}' does not load in onnxruntime: {_first_line(error)}") from None
    return lambda images: session.run([OUTPUT_NAME], {INPUT_NAME: images})[0]


def openvino_runner(path: Path, *, threads: int = 0, precision: str = "fp32") -> Callable[[np.ndarray], np.ndarray]:
    """A function running `path` (ONNX) compiled by OpenVINO for the CPU at `precision` (fp32 | bf16)."""
    ov = require_runtime("openvino")
    core = ov.Core()
    settings: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32",
                                "PERFORMANCE_HINT": "LATENCY"}
    if threads > 0:
        settings["INFERENCE_NUM_THREADS"] = threads
    try:
        compiled = core.compile_model(core.read_model(str(path)), "CPU", settings)
    except Exception as error:  # OpenVINO raises RuntimeError for files it cannot read
        raise ValueError(f"'{path}' does not load in openvino: {_first_line(error)}") from None
    request, output = compiled.create_infer_request(), compiled.output(0)

    def run(images: np.ndarray) -> np.ndarray:
        return np.array(request.infer({0: images})[output], copy=True)  # the request reuses its buffers

    return run


def open_runtime(runtime: str, path: Path, *, precision: str, threads: int = 0) -> RuntimeModel:
    """A RuntimeModel of `path` in `runtime` (onnxruntime | openvino)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"exported model '{path}' does not exist")
    if runtime == "onnxruntime":
        run = onnxruntime_runner(Path(path), threads=threads)
    else:
        run = openvino_runner(Path(path), threads=threads, precision=precision)
    return RuntimeModel(run, runtime=runtime, path=Path(path), precision=precision, threads=threads)


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_metadata(path: Path) -> dict[str, Any]:
    """An ONNX file's metadata (values JSON-decoded where they are JSON); ValueError naming the file when it
    is not an ONNX model."""
    try:
        import onnx
    except ImportError:
        raise RuntimeNotInstalled(f"reading '{path}' needs the package onnx (pip install \"syncseg[onnx]\")") from None
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # onnx raises DecodeError and others for a file that is not a model
        raise ValueError(f"'{path}' is not an ONNX model: {_first_line(error)}") from None
    metadata: dict[str, Any] = {}
    for entry in model.metadata_props:
        try:
            metadata[entry.key] = json.loads(entry.value)
        except ValueError:
            metadata[entry.key] = entry.value
    return metadata


def expected_metadata(config: Any, classes: list[str]) -> dict[str, Any]:
    """The MATCHED_KEYS values an export of a checkpoint with `config` and `classes` carries."""
    from syncseg.engine.export_formats import export_metadata

    full = export_metadata(classes=classes, config=config, checkpoint=Path(""), iteration=None)
    return {key: full[key] for key in MATCHED_KEYS}


def check_export_matches(path: Path, metadata: Mapping[str, Any], *, checkpoint: Path, digest: str,
                         expected: Mapping[str, Any]) -> None:
    """ValueError naming `path` and the key when the export's metadata is not the checkpoint's."""
    if metadata.get("producer") != "syncseg":
        raise ValueError(f"'{path}' was not written by `syncseg export` (its metadata has no producer=syncseg), so "
                         f"nothing says it is checkpoint '{checkpoint}''s model")
    if metadata.get("deepness"):
        raise ValueError(f"'{path}' is a QGIS Deepness export (fixed tiles, values / 255 in, probabilities out), "
                         "not the plain ONNX file a --runtime runs: export with --format onnx, without --deepness")
    if len(metadata.get("classes") or []) != len(expected["classes"]):
        raise ValueError(f"'{path}' predicts {len(metadata.get('classes') or [])} classes, checkpoint '{checkpoint}' "
                         f"{len(expected['classes'])}: export this checkpoint (python -m syncseg export --checkpoint "
                         f"{checkpoint} --format onnx)")
    for key in MATCHED_KEYS:
        if metadata.get(key) != expected[key]:
            raise ValueError(f"'{path}' was exported with {key}={metadata.get(key)!r}, checkpoint '{checkpoint}' has "
                             f"{expected[key]!r}: export this checkpoint (python -m syncseg export --checkpoint "
                             f"{checkpoint} --format onnx)")
    exported_from = metadata.get("checkpoint_sha256")
    if exported_from is not None and exported_from != digest:
        raise ValueError(f"'{path}' was exported from another checkpoint than '{checkpoint}' (checkpoint_sha256 "
                         f"{str(exported_from)[:12]}..., this one {digest[:12]}...): export this checkpoint")


def _cache_folders(checkpoint: Path) -> list[Path]:
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "syncseg" / "exports"
    return [checkpoint.parent / CACHE_FOLDER, user_cache]


def cache_key(digest: str, config: Any) -> str:
    """What decides the exported file: the checkpoint's bytes, the model's config, torch's version."""
    model = {key: getattr(config.model, key) for key in sorted(vars(config.model))}
    text = json.dumps([CACHE_VERSION, digest, torch.__version__, config.data.in_channels, model], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_export(checkpoint: Path, export: Callable[[Path], None], *, digest: str, config: Any) -> Path:
    """The ONNX export of `checkpoint` from the cache, writing it with `export(path)` when absent (atomically:
    a half-written file is never found). The first writable folder of `_cache_folders` holds it."""
    name = f"{checkpoint.stem}-{cache_key(digest, config)}.onnx"
    folders = _cache_folders(checkpoint)
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    problems = []
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            logger.info("exporting '%s' to ONNX once, into %s", checkpoint, folder)
            export(folder / name)
            return folder / name
        except OSError as error:
            problems.append(f"{folder}: {error.strerror or error}")
    raise OSError(f"could not write the ONNX export of '{checkpoint}' into any cache folder ({'; '.join(problems)}); "
                  "export it yourself (python -m syncseg export --format onnx --output FILE) and pass --exported FILE")


def runtime_model(model: nn.Module, *, config: Any, classes: list[str], checkpoint: Path, iteration: Any,
                  choice: RuntimeChoice, device: torch.device) -> RuntimeModel:
    """`model` (the checkpoint's, with its weights; modified by the export) as a RuntimeModel of
    `choice.runtime` running `choice.exported` or the cached export. ValueError for a device other than the
    CPU, a precision the runtime cannot run, a file that is not this checkpoint's export."""
    from syncseg.engine.export_formats import export_metadata, export_model, export_ready, sample_inputs

    require_runtime(choice.runtime)
    if device.type != "cpu":
        raise ValueError(f"--runtime {choice.runtime} runs on the CPU; got --device {device} (use --runtime torch "
                         "on a GPU)")
    if choice.threads < 0:
        raise ValueError(f"--threads {choice.threads}: expected 0 (the runtime's choice) or a positive count")
    precision, why = runtime_precision(choice.runtime, config.eval.amp, device)
    digest = file_digest(checkpoint)

    def export(path: Path) -> None:
        height, width = (max(32, side) for side in config.data.crop_size)
        metadata = export_metadata(classes=classes, config=config, checkpoint=checkpoint, iteration=iteration,
                                   checkpoint_sha256=digest)
        sample = sample_inputs(height, width, channels=config.data.in_channels)[0]
        export_model(export_ready(model), "onnx", path, sample=sample, metadata=metadata)

    path = Path(choice.exported) if choice.exported is not None else cached_export(checkpoint, export, digest=digest,
                                                                                   config=config)
    if not path.is_file():
        raise FileNotFoundError(f"--exported '{path}' does not exist")
    metadata = read_metadata(path)
    check_export_matches(path, metadata, checkpoint=checkpoint, digest=digest,
                         expected=expected_metadata(config, classes))
    loaded = open_runtime(choice.runtime, path, precision=precision, threads=choice.threads)
    if metadata.get("precision") == "int8":  # export.py --int8: int8 convolutions, `precision` for the rest
        loaded.precision = "int8"
        why = f"an int8 export (the layers between its quantized ones in {precision})"
    logger.info("running %s: eval.amp=%s, %s", loaded.describe(), config.eval.amp, why)
    return loaded
