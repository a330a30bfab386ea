import collections
import errno
import importlib
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

# Keep tests deterministic and light on the 2-core CI machine: at most 2 threads, and under pytest-xdist
# (`make test` runs 2 workers) the cores shared among the workers, the processes the tests start included
# (OMP_NUM_THREADS, unless a test sets its own). More threads than cores cost far more than they give: with
# 2 threads in each of 2 workers, OpenMP's waiting threads spin on the cores the other worker needs (the
# in-process training tests took 3-4x their CPU time).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
torch.set_num_threads(THREADS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    # Inductor's C++ compiles likewise (tests/e2e/test_compile.py, and the processes the tests start): in
    # the process itself, not in a pool of compile workers, which on a shared core only adds their start-up
    # (each imports torch): that test took 122 CPU-s with the default 2 threads and 110 with 1 (it runs
    # before torch._inductor's config is imported, which reads the variable).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(THREADS))
# The allocator setting every entry point of the product starts with (train.py, eval.py, predict.py and the Python
# API call syncseg.engine.allocator.keep_freed_memory before their first large tensor), here from the start of
# each pytest process rather than from whichever test first calls the API (process-wide and once: until then a
# worker ran with glibc's defaults, after it with the memory kept). The in-process tests then run as the product
# does: three of the heaviest in-process files took 58.7 s (70.1 CPU-s) with glibc's defaults, 51.8 s (64.2) so.
# A user's own MALLOC_* variables or LD_PRELOAD allocator are left alone, as in the product.
from syncseg.engine.allocator import keep_freed_memory  # noqa: E402

keep_freed_memory()
# train.amp/eval.amp=auto take the fp32 path on every CPU, so that no test's outcome or time depends on
# whether the CPU has native bf16 (AVX512_BF16/AMX: about 14x faster than emulated bf16 on AVX2 alone).
# Set in the environment, so the train.py / torchrun processes the tests start inherit it. Tests of the
# probe itself (tests/engine/test_distributed.py) replace it or clear the variable.
os.environ["SYNCSEG_NATIVE_BF16"] = "0"

PEAK_DISK_GIB = 3.5  # the most the suite's temporary folders held at once (measured: ~3.0 GiB)


def pytest_sessionstart(session):
    """Say up front when the temporary folder's disk is short of what the suite needs: otherwise the
    first sign is a checkpoint test failing with "No space left on device"."""
    folder = tempfile.gettempdir()
    free = shutil.disk_usage(folder).free / 2**30
    if free < PEAK_DISK_GIB:
        session.config.issue_config_time_warning(pytest.PytestWarning(
            f"{folder} has {free:.1f} GiB free; the test suite writes up to ~{PEAK_DISK_GIB} GiB of "
            "checkpoints there at once (set TMPDIR to a roomier disk)"), stacklevel=2)


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first, the order within a file kept. `make test` runs pytest-xdist
    file by file in this order (`-n 2 --dist loadfile --no-loadscope-reorder`): the long multi-process
    files start at once and the short tests of the other files fill the gaps after them, instead of a long
    file that was handed out last running alone at the end (xdist's own order is by test count). A file
    stays on one worker, so its module fixtures, such as the uninterrupted reference runs, run once."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture
def no_accelerator(monkeypatch):
    """nn.DataParallel as built on a machine without GPUs (it keeps the module and no device ids), also on a
    GPU machine, where `device_ids=[]` would fail with an IndexError."""
    # the module, not the function torch.nn.parallel.data_parallel that shadows its name
    module = importlib.import_module("torch.nn.parallel.data_parallel")
    monkeypatch.setattr(module, "_get_available_device_type", lambda: None)


def _tmpfs(folder, options: str):
    """Mount a tmpfs with `options` on the new folder `folder`, yield it, unmount it. Skips where mounting
    is not allowed (not root, no mount(8))."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"could not mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs under tmp_path: a filesystem that really fills up (short writes, then ENOSPC from the
    kernel), unmounted afterwards."""
    yield from _tmpfs(tmp_path / "disk", "size=4m")


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs under tmp_path (EROFS for everyone, root included, unlike chmod)."""
    yield from _tmpfs(tmp_path / "ro", "ro,size=1m")


def fill_disk(folder):
    """Take every free block of the filesystem under `folder` (small_disk's tmpfs) with a file `filler`."""
    with (folder / "filler").open("wb", buffering=0) as file:  # unbuffered: nothing left to flush at close
        try:
            while True:
                file.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
