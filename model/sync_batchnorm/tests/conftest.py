"""Fixtures of the package's tests, which run against the installed `sync_batchnorm` (torch and pytest only;
`make test-sbn` adds pytest-xdist)."""
from __future__ import annotations

import collections
import importlib
import os

import pytest
import torch

import sync_batchnorm

# At most 2 threads, and under pytest-xdist (`make test-sbn` runs 2 workers) the cores shared among the workers:
# more threads than cores only spin on the cores the other worker needs.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))
# Inductor compiles in this process and in the spawned gloo ranks (inherited), not in a pool of compile
# workers per process: the ranks of a compiled test already take every core of a 2-core machine, and each
# pool's workers pay torch's import again (test_compile.py: 134 CPU-s and 83 s with the default 2 threads
# on 2 cores, 116 CPU-s and 71 s with 1). A value in the environment is kept.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first, the order within a file kept: under `-n 2 --dist loadfile
    --no-loadscope-reorder` (`make test-sbn`) the long multi-process files start at once and the short files fill
    the gaps beside them, instead of a long file handed out last running alone at the end."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture
def no_accelerator(monkeypatch):
    """nn.DataParallel as built on a machine without GPUs (it keeps the module and no device ids), also on a
    GPU machine, where `device_ids=[]` would fail with an IndexError."""
    # the module, not the function torch.nn.parallel.data_parallel that shadows its name
    module = importlib.import_module("torch.nn.parallel.data_parallel")
    monkeypatch.setattr(module, "_get_available_device_type", lambda: None)


@pytest.fixture
def eps_mode():
    """Set the process-wide eps mode for one test: `eps_mode("clamp")`; restored afterwards."""
    saved = sync_batchnorm.get_sbn_eps_mode()
    yield sync_batchnorm.set_sbn_eps_mode
    sync_batchnorm.set_sbn_eps_mode(saved)
