"""Devices and precision: `--gpus` and `--device` parsed, and what `train.amp` / `eval.amp`
(auto | off | tf32 | fp16 | bf16) run as on a device, with its autocast and its TF32 flags.

`parse_gpus` and `inference_device` are the one parsers of `--gpus` (train.py) and `--device` (eval.py,
predict.py, export.py).

`resolve_precision(precision, device)` is the one table from the config value to what runs, by the
device's capability (`native_bf16` and `native_tf32`, the probes); `autocast_for(device, precision)` its
autocast context, which on CUDA also sets TF32 for what runs (`apply_fp32_precision` sets it process-wide,
for training's backward): TF32 matmuls and convolutions exactly when the precision is tf32, so `off` is
full fp32 (IEEE) on Ampere and newer too, as the log says, not cuDNN's default TF32 convolutions.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

# syncseg.engine.config.Precision less auto; tf32 is fp32 tensors (no autocast) with TF32 matmuls and convolutions
_AUTOCAST_DTYPES = {"off": None, "tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# Overrides the CPU bf16 probe ("0" or "1"): the tests set 0 so that no outcome or time depends on the CPU
NATIVE_BF16_VARIABLE = "SYNCSEG_NATIVE_BF16"
# how many times slower bf16 runs than fp32 where the CPU emulates it (no AVX512_BF16/AMX), as the log says when
# a config asks for bf16 there (docs/training.md, "Precision and speed", has the measurement)
EMULATED_BF16_SLOWDOWN = 14


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where that file does not exist."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return frozenset()
    return frozenset(word for line in text.splitlines() if line.startswith("flags") for word in line.split())


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 in hardware: a CUDA device with native bf16 (compute capability 8.0+;
    emulation does not count), a CPU with AVX512_BF16 or AMX (SYNCSEG_NATIVE_BF16=0/1 overrides the CPU
    probe). The one capability probe behind `train.amp=auto` / `eval.amp=auto`; tests replace it."""
    if device.type == "cuda":
        if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        override = os.environ.get(NATIVE_BF16_VARIABLE, "").strip()
        if override in ("0", "1"):
            return override == "1"
        flags = _cpu_flags()
        if flags:
            return bool(flags & {"avx512_bf16", "amx_bf16"})
        probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # no /proc/cpuinfo: ask torch (private API)
        return bool(probe()) if probe is not None else False
    return False


def native_tf32(device: torch.device) -> bool:
    """Whether `device` computes fp32 matmuls and convolutions in TF32 when asked: a CUDA device of compute
    capability 8.0+ (Ampere and later). Tests replace it."""
    return device.type == "cuda" and tuple(torch.cuda.get_device_capability(device)) >= (8, 0)


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """(what runs: off | tf32 | fp16 | bf16, why) for `precision` (train.amp / eval.amp: auto | off | tf32 |
    fp16 | bf16) on `device`. auto: bf16 where `native_bf16(device)`, else fp16 (with a GradScaler in
    training) on CUDA, else off (fp32). tf32 runs as off where `native_tf32(device)` is false. An explicit
    value otherwise runs as given."""
    if precision == "tf32" and not native_tf32(device):
        where = "this GPU (compute capability below 8.0)" if device.type == "cuda" else device.type
        return "off", f"tf32 as configured, but {where} has no TF32, so fp32"
    if precision != "auto":
        if precision == "bf16" and device.type == "cpu" and not native_bf16(device):
            return "bf16", (f"as configured; this CPU has no native bf16 (AVX512_BF16/AMX), so bf16 is emulated "
                            f"and about {EMULATED_BF16_SLOWDOWN}x slower than fp32: set it to auto or off")
        return precision, "as configured"
    if native_bf16(device):
        return "bf16", f"auto: {device.type} computes bf16 natively"
    if device.type == "cuda":
        return "fp16", "auto: this GPU has no native bf16, so fp16 with a GradScaler"
    return "off", f"auto: {device.type} has no native bf16 (AVX512_BF16/AMX), so fp32"


def describe_precision(chosen: str, device: torch.device) -> str:
    """What `chosen` (resolve_precision's off | tf32 | fp16 | bf16) computes on `device`, for the log."""
    if device.type != "cuda":
        return "fp32" if chosen == "off" else chosen
    return {"off": "fp32 (TF32 off: matmuls and convolutions in full fp32)",
            "tf32": "tf32 (fp32 tensors, matmuls and convolutions in TF32)"}.get(
        chosen, f"{chosen} (TF32 off for what runs in fp32)")


def log_precision(key: str, precision: str, device: torch.device) -> str:
    """Log what `key` (train.amp / eval.amp) = `precision` runs as on `device`, and why (on CUDA, whether
    TF32 is on); warns when it is emulated bf16. Returns what runs (off | tf32 | fp16 | bf16)."""
    chosen, why = resolve_precision(precision, device)
    if "emulated" in why:
        logger.warning("%s=%s: %s", key, precision, why)
    else:
        logger.info("%s=%s: %s (%s)", key, precision, describe_precision(chosen, device), why)
    return chosen


def set_tf32(enabled: bool) -> tuple[bool, bool]:
    """Set TF32 for fp32 matmuls (cuBLAS) and convolutions (cuDNN) process-wide; returns the previous
    (matmul, cudnn) pair. Through the `allow_tf32` flags, which torch 2.11 to 2.14 all have and which keep
    the newer `fp32_precision` settings in step: setting `cudnn.conv.fp32_precision` alone leaves the
    legacy cuDNN flag behind, and any later read of `torch.backends.cudnn.allow_tf32` then raises."""
    previous = (bool(torch.backends.cuda.matmul.allow_tf32), bool(torch.backends.cudnn.allow_tf32))
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return previous


def apply_fp32_precision(chosen: str, device: torch.device) -> None:
    """Process-wide, for what runs outside `autocast_for` (training's backward): on CUDA, TF32 exactly when
    `chosen` (resolve_precision's answer) is tf32, else full fp32 for fp32 matmuls and convolutions.
    Nothing on other devices."""
    if device.type == "cuda":
        set_tf32(chosen == "tf32")


# Backbones whose fp32 convolutions oneDNN runs faster channels-last on a CPU with AVX-512 and with AVX2 kernels
# alike; ResNet-18 and MobileNetV3 do not (the measurements: docs/training.md, "Precision and speed")
CPU_FP32_CHANNELS_LAST_BACKBONES = frozenset({"resnet50", "resnet101"})


def resolve_channels_last(setting: str | bool, precision: str, device: torch.device,
                          backbone: str | None = None) -> tuple[bool, str]:
    """(channels-last or not, why) for model.channels_last = `setting` (auto | True | False) when `precision`
    runs on `device`: auto is channels-last when that precision resolves to bf16 or fp16 (resolve_precision),
    and in fp32 on a CPU for the `backbone`s in CPU_FP32_CHANNELS_LAST_BACKBONES. Training and inference both
    pass train.amp and model.backbone, so both build the same layout."""
    if setting != "auto":
        return bool(setting), "as configured"
    chosen = resolve_precision(precision, device)[0]
    if chosen in ("bf16", "fp16"):
        return True, f"auto: {chosen} kernels want channels-last"
    if torch.device(device).type == "cpu" and backbone in CPU_FP32_CHANNELS_LAST_BACKBONES:
        return True, f"auto: a CPU runs {backbone}'s fp32 convolutions faster channels-last"
    return False, f"auto: {'fp32' if chosen == 'off' else chosen} runs in the usual layout"


@contextlib.contextmanager
def autocast_for(device: torch.device, precision: str) -> Iterator[None]:
    """The context that runs `precision` (auto | off | tf32 | fp16 | bf16) on `device`: its autocast, and
    on CUDA TF32 on exactly for tf32 (restored on exit), so training, validation, eval.py and predict.py
    each compute as their key says."""
    chosen = resolve_precision(precision, device)[0]
    dtype = _AUTOCAST_DTYPES[chosen]
    previous = set_tf32(chosen == "tf32") if device.type == "cuda" else None
    try:
        if dtype is None:
            yield
        else:
            with torch.autocast(device_type=device.type, dtype=dtype):
                yield
    finally:
        if previous is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@contextlib.contextmanager
def cudnn_autotuning(enabled: bool) -> Iterator[None]:
    """cuDNN's autotuning (`torch.backends.cudnn.benchmark`) set to `enabled` inside, restored on exit. The
    flag is process-wide: training turns it on for its one crop size (distributed.wrap_for_training), and
    each input size it sees is timed over every algorithm once."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


def parse_gpus(gpus: str) -> tuple[int, ...]:
    """`"0,1,3"` -> (0, 1, 3). Raises ValueError naming the value when it is not a list of ids."""
    parts = [p.strip() for p in gpus.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"--gpus {gpus!r}: expected comma-separated GPU ids such as 0,1 (or 'cpu')")
    ids = []
    for part in parts:
        if not part.isdigit():
            raise ValueError(f"--gpus {gpus!r}: '{part}' is not a GPU id; expected comma-separated integers such as 0,1")
        ids.append(int(part))
    if len(set(ids)) != len(ids):
        raise ValueError(f"--gpus {gpus!r}: a GPU id is listed twice")
    return tuple(ids)


def inference_device(name: str | None, *, torchrun_device: torch.device | None = None) -> torch.device:
    """The device for eval.py / predict.py: `name` (cpu, cuda, cuda:N; None = cuda if available, else
    cpu), or `torchrun_device`, this process's device under torchrun (syncseg.engine.distributed.DistInfo.device
    in mode ddp), when given. ValueError naming the value when it cannot be used."""
    if torchrun_device is not None:
        if name is not None:
            raise ValueError(f"--device {name} cannot be combined with torchrun: each process uses "
                             "cuda:LOCAL_RANK (or the CPU without CUDA)")
        return torchrun_device
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if device.index is None:
            # plain "cuda" is the current device; set_device rejects a device without an index
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    return device
