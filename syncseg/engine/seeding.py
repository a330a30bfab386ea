"""Randomness that a resumed run replays exactly: per-sample seeds, worker init, every RNG's state.

A training sample is loaded as (index, seed): `SeededDataset` seeds python, numpy and torch from that
seed, and the dataset's augmentation draws its own seed from torch (syncseg.data.transforms.PairTransform), so a
sample's augmentation depends on neither the worker nor the process that loads it. `capture_rng_state` / `restore_rng_state` carry every global RNG
of a process through a checkpoint (tensors and primitives only, so it loads with weights_only=True).
"""
from __future__ import annotations

import hashlib
import os
import random
import signal
from typing import Any, Mapping

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info


def mix_seed(*values: Any) -> int:
    """A 63-bit seed that is a stable function of `values` (any printable values)."""
    digest = hashlib.sha256(":".join(map(str, values)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_process(seed: int, rank: int, *, iteration: int | None = None) -> None:
    """Seed torch, python and numpy for training process `rank` (its own streams, e.g. for dropout); with
    `iteration`, streams of their own for a resume that cannot restore the saved ones (another world size)."""
    at = () if iteration is None else (iteration,)
    torch.manual_seed(mix_seed(seed, "train", rank, *at))
    random.seed(mix_seed(seed, "python", rank, *at))
    np.random.seed(mix_seed(seed, "numpy", rank, *at) % 2**32)


class SeededDataset(Dataset):
    """Wraps a dataset so that item (index, seed) is produced with python random, numpy and torch seeded
    from `seed` (augmentation pipelines seed themselves from torch: syncseg.data.transforms.PairTransform). The caller's global RNG
    states are restored afterwards, so loading in the main process (num_workers=0) does not perturb
    training's random stream. Only the host generators are seeded: `torch.manual_seed` would also reseed
    every CUDA generator (and the main process restores only the host states), so each PreciseBN pass
    would reset the GPUs' streams and dropout masks would repeat after every validation."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        if get_worker_info() is not None:  # a worker's global RNG streams serve nothing else
            return self._seeded_item(index, seed)
        python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            return self._seeded_item(index, seed)
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
            torch.set_rng_state(torch_state)

    def _seeded_item(self, index: int, seed: int) -> Any:
        random.seed(seed)
        np.random.seed(seed)
        torch.random.default_generator.manual_seed(seed)  # the CPU generator only, unlike torch.manual_seed
        return self.dataset[index]


def worker_init(worker_id: int) -> None:
    """DataLoader worker_init_fn: ignore SIGINT and SIGTERM (a signal to the whole process group is the
    main process's to handle: it finishes the step, saves and shuts the workers down; see
    syncseg.engine.samplers.shutdown_workers), then seed numpy and `random` from the worker's torch seed.

    torch already gives each worker its own seed (base seed + worker id, the base drawn from the
    loader's generator); this extends it to numpy / random for any user code in the worker. It
    deliberately does not call cv2.setNumThreads: in a forked worker whose parent already ran cv2's
    thread pool that call hangs.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _release_forkserver_alive_fd()
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _release_forkserver_alive_fd() -> None:
    """Close this worker's copy of the pipe whose end tells a forkserver that its process is gone.

    A worker started from a forkserver (syncseg.engine.samplers.worker_context) gets that pipe's write end
    from the process that asked for it. While any copy is open the server never sees the process exit,
    and the worker, whose parent is the server, never sees it either (torch's worker watchdog watches the
    parent): a training process killed with SIGKILL would leave both behind for good, holding its
    stdout and stderr. Without the worker's copy the server exits with the process, and the worker follows
    within torch's status-check interval (5 s). A forked worker's copy (of a server its process started)
    is closed alike: only the process itself starts workers through its server."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    descriptor = getattr(server, "_forkserver_alive_fd", None)
    if descriptor is None:
        return
    try:
        os.close(descriptor)
    except OSError:
        pass
    server._forkserver_alive_fd = None  # type: ignore[union-attr]


def capture_rng_state() -> dict[str, Any]:
    """Every RNG state of this process as tensors and primitives (loads with weights_only=True)."""
    python_version, python_state, python_gauss = random.getstate()
    _, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {
        "python_version": int(python_version),
        "python_state": torch.tensor(python_state, dtype=torch.int64),
        "python_gauss": python_gauss,
        "numpy_keys": torch.from_numpy(np.asarray(numpy_keys, dtype=np.int64)),
        "numpy_pos": int(numpy_pos),
        "numpy_has_gauss": int(numpy_has_gauss),
        "numpy_gauss": float(numpy_gauss),
        "torch": torch.get_rng_state(),
        "cuda": list(cuda),
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of capture_rng_state."""
    random.setstate((state["python_version"], tuple(int(v) for v in state["python_state"].tolist()),
                     state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
