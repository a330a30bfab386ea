"""Precision: what `train.amp` / `eval.amp` (auto | off | fp16 | bf16) run as on a device, and its autocast.

`resolve_precision(precision, device)` is the one table from the config value to what runs, by the
device's capability (`native_bf16`, the one probe); `autocast_for(device, precision)` its autocast context.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os

import torch

logger = logging.getLogger(__name__)

_AUTOCAST_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}  # engine.config.Precision
# Overrides the CPU bf16 probe ("0" or "1"): the tests set 0 so that no outcome or time depends on the CPU
NATIVE_BF16_VARIABLE = "SYNCSEG_NATIVE_BF16"
# measured on a 2-core AVX2 CPU (no AVX512_BF16/AMX): the demo trained at 1.0 img/s in bf16, 14 img/s in fp32
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


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """(what runs: off | fp16 | bf16, why) for `precision` (train.amp / eval.amp: auto | off | fp16 | bf16)
    on `device`. auto: bf16 where `native_bf16(device)`, else fp16 (with a GradScaler in training) on
    CUDA, else off (fp32). An explicit value runs as given."""
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


def log_precision(key: str, precision: str, device: torch.device) -> str:
    """Log what `key` (train.amp / eval.amp) = `precision` runs as on `device`, and why; warns when it is
    emulated bf16. Returns what runs (off | fp16 | bf16)."""
    chosen, why = resolve_precision(precision, device)
    if "emulated" in why:
        logger.warning("%s=%s: %s", key, precision, why)
    else:
        logger.info("%s=%s: %s (%s)", key, precision, "fp32" if chosen == "off" else chosen, why)
    return chosen


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The autocast context for `precision` (auto | off | fp16 | bf16) on `device`."""
    dtype = _AUTOCAST_DTYPES[resolve_precision(precision, device)[0]]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
