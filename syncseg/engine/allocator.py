"""Keep freed memory for reuse: the allocator setting training, evaluation and prediction run with on CPU.

glibc hands every freed block above its mmap threshold (dynamic, starting at 128 KiB) back to the operating
system, and trims the heap's top above 128 KiB. A training step frees and allocates the same
multi-megabyte activations again and again, so each fresh tensor pays page faults that cost more than the
arithmetic of a BatchNorm or an elementwise layer (tests/engine/test_allocator.py: a small conv-BN
training step took 4000-14000 page faults a step with glibc's defaults, 0-4096 once the heap settled with
the memory kept; docs/training.md, "Precision and speed"). torchvision's reference trainer, run from a
user's shell, pays the same.

`keep_freed_memory()` raises both thresholds through `mallopt` at start-up (what MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ would do, without re-executing the process): blocks up to 1 GiB come from the heap,
and the heap is never trimmed, so a freed activation is reused by the next one. Its cost is memory that
stays mapped after a peak (the peak itself does not grow). It does nothing, and says why, when:
- the process does not run on glibc (musl, macOS, Windows);
- the user chose an allocator: any MALLOC_* variable glibc reads, or an LD_PRELOAD of jemalloc, tcmalloc or
  mimalloc;
- SYNCSEG_KEEP_FREED_MEMORY=0 asks for glibc's defaults.
Data-loading workers are forked after it runs and inherit the setting.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: 2 GiB, more than any top of heap freed at once
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                  "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_done: list[str] = []  # the decision, once per process


def keep_freed_memory(environ: dict[str, str] | None = None) -> str:
    """Set glibc to keep freed memory (see the module's docstring) unless the user chose otherwise; returns
    one line saying what the process runs with. Idempotent: later calls return the first decision."""
    if _done:
        return _done[0]
    env = os.environ if environ is None else environ
    decision = _decide(env)
    _done.append(decision)
    return decision


def _decide(env) -> str:
    if env.get("SYNCSEG_KEEP_FREED_MEMORY", "1") == "0":
        return "allocator: glibc's defaults (SYNCSEG_KEEP_FREED_MEMORY=0)"
    preload = env.get("LD_PRELOAD", "")
    chosen = [name for name in OTHER_ALLOCATORS if name in preload]
    if chosen:
        return f"allocator: {chosen[0]} from LD_PRELOAD, left as it is"
    own = [name for name in USER_VARIABLES if name in env]
    if own:
        return f"allocator: glibc with your {', '.join(own)}, left as it is"
    libc = _glibc()
    if libc is None:
        return f"allocator: the platform's ({sys.platform}, not glibc), left as it is"
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        return "allocator: glibc's defaults (mallopt refused the thresholds)"
    return ("allocator: glibc, freed memory kept for reuse (mmap threshold 1 GiB, no trimming: fewer page faults, "
            "memory stays mapped after a peak; SYNCSEG_KEEP_FREED_MEMORY=0 for glibc's defaults)")


def _glibc():
    """glibc through ctypes, or None where the C library is another one."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    except (OSError, AttributeError):
        return None
    return libc
