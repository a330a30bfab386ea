"""Devices: CPU, one process over several GPUs (DataParallel), or torchrun (DDP); precision; rank helpers.

`setup_distributed(gpus)` decides the training topology once, from the `--gpus` value and the torchrun
environment (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`), and returns a `DistInfo`. The rest of the engine
asks `DistInfo` (or the helpers below, which read torch.distributed) instead of the environment.
`inference_device(name)` is the one parser of `--device` for eval.py and predict.py, and
`autocast_for(device, precision)` the one table from `train.amp` / `eval.amp` to autocast.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_AUTOCAST_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}  # engine.config.Precision


@dataclass(frozen=True)
class DistInfo:
    """Where this process runs.

    mode: "cpu" (one process, CPU), "dp" (one process, `device_ids` GPUs through
    DataParallelWithCallback; `device` is the first of them) or "ddp" (one process per device under
    torchrun; `device` is this process's device, CPU with gloo when there is no CUDA).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mode: str = "cpu"
    device_ids: tuple[int, ...] = ()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_replicas(self) -> int:
        """Number of model replicas sharing the global batch (DP devices or DDP processes)."""
        if self.mode == "dp":
            return max(1, len(self.device_ids))
        return self.world_size

    def describe(self) -> str:
        if self.mode == "ddp":
            return f"DDP over {self.world_size} processes"
        if self.num_replicas > 1:
            return f"DataParallel over GPUs {','.join(map(str, self.device_ids))}"
        return f"one device ({self.device})"


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


def _torchrun_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"environment WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def setup_distributed(gpus: str | None) -> DistInfo:
    """Pick the device(s) and, under torchrun, initialize the process group.

    - torchrun (WORLD_SIZE > 1): DDP, one device per process: `cuda:LOCAL_RANK` with NCCL when CUDA
      is available, CPU with gloo otherwise. `gpus` must then be None.
    - `gpus="cpu"`: CPU, even when CUDA is available.
    - `gpus="0,1"`: one process over those GPUs (mode "dp"); a missing id raises ValueError.
    - `gpus=None`: GPU 0 (mode "dp" with one device) when CUDA is available, else CPU.
    """
    world_size = _torchrun_world_size()
    if world_size > 1:
        if gpus is not None:
            raise ValueError(
                f"--gpus {gpus} cannot be combined with torchrun (WORLD_SIZE={world_size}); torchrun gives each "
                "process one device: restrict the visible GPUs with CUDA_VISIBLE_DEVICES instead"
            )
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            if local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                    "use --nproc_per_node <= the number of GPUs"
                )
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            backend = "nccl"
            device_ids: tuple[int, ...] = (local_rank,)
        else:
            device = torch.device("cpu")
            backend = "gloo"
            device_ids = ()
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        logger.info("torchrun: rank %d/%d, local rank %d, %s backend, device %s",
                    rank, world_size, local_rank, backend, device)
        return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mode="ddp",
                        device_ids=device_ids)

    if gpus is not None and gpus.strip().lower() == "cpu":
        return DistInfo()
    if gpus is None:
        if torch.cuda.is_available():
            return DistInfo(device=torch.device("cuda", 0), mode="dp", device_ids=(0,))
        return DistInfo()
    ids = parse_gpus(gpus)
    if not torch.cuda.is_available():
        raise ValueError(f"--gpus {gpus}: no CUDA device is available on this machine; omit --gpus to train on CPU")
    count = torch.cuda.device_count()
    missing = [i for i in ids if i >= count]
    if missing:
        raise ValueError(
            f"--gpus {gpus}: GPU id(s) {', '.join(map(str, missing))} do not exist; "
            f"this machine has {count} GPU(s): ids 0..{count - 1}"
        )
    return DistInfo(device=torch.device("cuda", ids[0]), mode="dp", device_ids=ids)


def inference_device(name: str | None, dist_info: DistInfo | None = None) -> torch.device:
    """The device for eval.py / predict.py: `name` (cpu, cuda, cuda:N; None = cuda if available, else
    cpu), or this process's device under torchrun. ValueError naming the value when it cannot be used."""
    if dist_info is not None and dist_info.mode == "ddp":
        if name is not None:
            raise ValueError(f"--device {name} cannot be combined with torchrun: each process uses "
                             "cuda:LOCAL_RANK (or the CPU without CUDA)")
        return dist_info.device
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    return device


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The autocast context for `precision` (off | fp16 | bf16) on `device`."""
    dtype = _AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    """Wait for every process; no-op outside torch.distributed."""
    if is_dist():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over processes in place (no-op outside torch.distributed); returns it."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(value: object, *, src: int = 0) -> object:
    """Rank `src`'s value on every process (identity outside torch.distributed)."""
    if not is_dist():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def cleanup(*, synchronize: bool = True) -> None:
    """Destroy the process group if this process created one.

    Drop DistributedDataParallel wrappers before calling this: destroying a gloo group that a live DDP
    still holds aborted ~1 in 3 processes at exit ("terminate called without an active exception").
    `synchronize` waits for every rank first (skip it on error paths, where a peer may never arrive).
    """
    if is_dist():
        gc.collect()
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()
