"""Devices and precision: `--gpus` and `--device` parsed, and what `train.amp` / `eval.amp`
(auto | off | fp16 | bf16) run as on a device, with its autocast.

`parse_gpus` and `inference_device` are the one parsers of `--gpus` (train.py) and `--device` (eval.py,
predict.py, export.py).

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

_AUTOCAST_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}  # syncseg.engine.config.Precision
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


def resolve_channels_last(setting: str | bool, precision: str, device: torch.device) -> tuple[bool, str]:
    """(channels-last or not, why) for model.channels_last = `setting` (auto | True | False) when `precision`
    runs on `device`: auto is channels-last exactly when that precision resolves to bf16 or fp16
    (resolve_precision). Training and inference both pass train.amp, so both build the same layout."""
    if setting != "auto":
        return bool(setting), "as configured"
    chosen = resolve_precision(precision, device)[0]
    if chosen in ("bf16", "fp16"):
        return True, f"auto: {chosen} kernels want channels-last"
    return False, "auto: fp32 runs in the usual layout"


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The autocast context for `precision` (auto | off | fp16 | bf16) on `device`."""
    dtype = _AUTOCAST_DTYPES[resolve_precision(precision, device)[0]]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


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
