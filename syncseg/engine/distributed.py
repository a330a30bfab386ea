"""Training topology: CPU, one process over several GPUs (DataParallel), or torchrun/srun (DDP); collectives.

`setup_distributed(gpus)` decides the training topology once, from the `--gpus` value and the torchrun
environment (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`), and returns a `DistInfo`. The rest of the engine
asks `DistInfo` (or the helpers below, which read torch.distributed) instead of the environment.
Parsing `--gpus` and `--device`, and precision, are syncseg.engine.devices's.
"""
from __future__ import annotations

import datetime
import gc
import inspect
import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from syncseg.engine.devices import parse_gpus
from syncseg.model.sync_batchnorm import DataParallelWithCallback, synchronized_layers

logger = logging.getLogger(__name__)

# What NCCL's watchdog does when a collective fails or times out, read when an NCCL group is made. torchrun
# sets 1 (abort the communicators and kill the process; torch's own default, 3, kills it too). A hung peer
# then killed each process at NCCL's timeout, before the gloo stop agreement (the same dist.timeout_s, started
# a little later) could raise the one-line "lost contact" error. 2 aborts the communicators and leaves the
# process to report: the agreement, which waits on a CPU tensor, raises and train.py exits 1 with that line.
NCCL_ERROR_HANDLING_VARIABLE = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERROR_HANDLING_CLEAN_UP_ONLY = "2"


@dataclass(frozen=True)
class Launch:
    """How this process was started: alone, by torchrun (torchelastic) or as one of srun's tasks."""

    launcher: str = "none"  # none | torchrun | slurm
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    num_nodes: int = 1
    elastic: bool = False  # under torchelastic: a restarted worker resumes from the run dir's last.pt
    restart_count: int = 0
    init_method: str = "env://"  # where the processes meet


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
    launch: Launch = field(default_factory=lambda: Launch())

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

    def describe_batch_norm(self, *, synchronized: bool) -> str:
        """How BatchNorm statistics are reduced here, for the log; `synchronized`: the model's norm layers
        synchronize (syncseg.model.norm.synchronizes_statistics)."""
        if self.num_replicas == 1:
            return "single device (plain batch norm)"
        if not synchronized:
            return "not synchronized (per process)" if self.mode == "ddp" else "not synchronized (per GPU)"
        return ("across the processes through torch.distributed" if self.mode == "ddp"
                else "across the GPUs (DataParallelWithCallback)")


def _int_variable(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment {name}={value!r} is not an integer") from None


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,7],login2") -> ["gpu01", "gpu02", "gpu03", "gpu7", "login2"]."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?(?:,|$)", hostlist.strip()):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            if not last:
                hosts.append(prefix + first)
                continue
            hosts += [f"{prefix}{number:0{len(first)}d}" for number in range(int(first), int(last) + 1)]
    return hosts


def detect_launch(environ: Mapping[str, str] = os.environ) -> Launch:
    """Read the launcher's environment: torchrun's WORLD_SIZE/RANK/LOCAL_RANK (and TORCHELASTIC_*), or,
    without them, the SLURM_* variables of a task that srun started (SLURM_STEP_ID is set: a plain
    `python train.py` in an sbatch script stays one process). Raises ValueError with one line when the
    variables cannot describe a run."""
    if "WORLD_SIZE" in environ or "TORCHELASTIC_RUN_ID" in environ:
        world_size = _int_variable(environ, "WORLD_SIZE", 1)
        local_world_size = _int_variable(environ, "LOCAL_WORLD_SIZE", world_size)
        return Launch(
            launcher="torchrun", rank=_int_variable(environ, "RANK", 0), world_size=world_size,
            local_rank=_int_variable(environ, "LOCAL_RANK", 0), local_world_size=local_world_size,
            num_nodes=_int_variable(environ, "GROUP_WORLD_SIZE", max(1, world_size // max(1, local_world_size))),
            elastic="TORCHELASTIC_RUN_ID" in environ,
            restart_count=_int_variable(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        )
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        world_size = _int_variable(environ, "SLURM_STEP_NUM_TASKS", _int_variable(environ, "SLURM_NTASKS", 1))
        if world_size == 1:
            return Launch()
        hosts = expand_hostlist(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST", ""))
        address = environ.get("MASTER_ADDR") or (hosts[0] if hosts else "")
        if not address:
            raise ValueError(f"srun started {world_size} tasks but SLURM_NODELIST is not set, so there is no address "
                             "to meet at; set MASTER_ADDR to the first node's address, or run srun inside an allocation "
                             "(sbatch scripts/slurm/train.sbatch), where Slurm sets SLURM_NODELIST")
        # a port of this job's own, so that two jobs sharing a node do not meet each other
        port = _int_variable(environ, "MASTER_PORT", 20000 + _int_variable(environ, "SLURM_JOB_ID", 0) % 20000)
        num_nodes = _int_variable(environ, "SLURM_STEP_NUM_NODES", _int_variable(environ, "SLURM_NNODES", len(hosts)))
        return Launch(
            launcher="slurm", rank=_int_variable(environ, "SLURM_PROCID"), world_size=world_size,
            local_rank=_int_variable(environ, "SLURM_LOCALID", 0),
            local_world_size=max(1, world_size // max(1, num_nodes)), num_nodes=max(1, num_nodes),
            init_method=f"tcp://{address}:{port}",
        )
    return Launch()


def setup_distributed(gpus: str | None, *, timeout_s: float = 300.0, launch: Launch | None = None) -> DistInfo:
    """Pick the device(s) and, under torchrun or srun with several processes, initialize the process group.

    - torchrun / srun (world size > 1): DDP, one device per process: `cuda:LOCAL_RANK` with NCCL when
      CUDA is available, CPU with gloo otherwise. `gpus` must then be None. Every collective waits at
      most `timeout_s` seconds (dist.timeout_s) for the other processes.
    - `gpus="cpu"`: CPU, even when CUDA is available.
    - `gpus="0,1"`: one process over those GPUs (mode "dp"); a missing id raises ValueError.
    - `gpus=None`: GPU 0 (mode "dp" with one device) when CUDA is available, else CPU.
    """
    launch = launch or detect_launch()
    if launch.world_size <= 1:
        return replace(_single_process(gpus), launch=launch)
    if gpus is not None:
        raise ValueError(
            f"--gpus {gpus} cannot be combined with {launch.launcher} (world size {launch.world_size}); each "
            "process gets one device: restrict the visible GPUs with CUDA_VISIBLE_DEVICES instead"
        )
    rank, world_size, local_rank = launch.rank, launch.world_size, launch.local_rank
    options: dict[str, Any] = {}
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                "use --nproc_per_node <= the number of GPUs"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NCCL for the model's tensors; gloo for CPU tensors (the per-step stop agreement, syncseg.engine.signals),
        # torch's own default pairing, so agreeing on a stop never waits for the GPU
        backend, device_ids = "cpu:gloo,cuda:nccl", (local_rank,)
        options["device_id"] = device  # NCCL binds its communicator to this GPU at once
        previous = os.environ.get(NCCL_ERROR_HANDLING_VARIABLE)
        os.environ[NCCL_ERROR_HANDLING_VARIABLE] = NCCL_ERROR_HANDLING_CLEAN_UP_ONLY
        if previous not in (None, NCCL_ERROR_HANDLING_CLEAN_UP_ONLY):
            logger.info("%s=%s (was %s): a failed or timed-out NCCL collective aborts the communicators but "
                        "leaves the process to report a lost peer in one line and exit 1",
                        NCCL_ERROR_HANDLING_VARIABLE, NCCL_ERROR_HANDLING_CLEAN_UP_ONLY, previous)
    else:
        device, backend, device_ids = torch.device("cpu"), "gloo", ()
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=launch.init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **options)
    logger.info("%s: rank %d/%d, local rank %d, %s backend, device %s, collectives time out after %g s",
                launch.launcher, rank, world_size, local_rank, backend, device, timeout_s)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mode="ddp",
                    device_ids=device_ids, launch=launch)


def _single_process(gpus: str | None) -> DistInfo:
    if gpus is not None and gpus.strip().lower() == "cpu":
        return DistInfo()
    if gpus is None:
        if not torch.cuda.is_available():
            return DistInfo()
        gpus = "0"
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
    device = torch.device("cuda", ids[0])
    # the current device before anything touches CUDA: otherwise the pin-memory thread, the GradScaler and
    # every tensor made without a device open a context on GPU 0, which --gpus 2,3 did not ask for
    torch.cuda.set_device(device)
    return DistInfo(device=device, mode="dp", device_ids=ids)


def wrap_for_training(model: nn.Module, dist_info: DistInfo) -> nn.Module:
    """The module train steps call: DistributedDataParallel under torchrun/srun, DataParallelWithCallback
    over several --gpus, else `model` itself. On CUDA, cudnn picks its fastest kernels (the crops have
    one size, so the search runs once; validation autotunes only the sizes that come back:
    syncseg.engine.evaluate)."""
    if dist_info.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if dist_info.mode == "ddp":
        device_ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
        return distributed_data_parallel(model, device_ids=device_ids)
    if dist_info.num_replicas > 1:
        return DataParallelWithCallback(model, device_ids=list(dist_info.device_ids))
    return model


def assign_sync_groups(model: nn.Module, dist_info: DistInfo, *, group_size: int, timeout_s: float) -> None:
    """model.syncbn_group_size: the synchronized BatchNorm layers of `model` reduce within groups of
    `group_size` consecutive ranks (0: over all processes, the layers' default). Every rank must call this
    (torch.distributed.new_subgroups makes every group on every rank). ValueError naming the key unless
    `group_size` divides the world size."""
    if group_size == 0 or group_size == dist_info.world_size:
        return
    if dist_info.world_size % group_size:
        raise ValueError(
            f"model.syncbn_group_size={group_size} does not divide the world size {dist_info.world_size} "
            f"({'one process' if dist_info.world_size == 1 else dist_info.launch.launcher + ' processes'}): "
            "use a divisor of it (e.g. the processes per node), or 0 to synchronize over all processes")
    group, _ = dist.new_subgroups(group_size=group_size, timeout=datetime.timedelta(seconds=timeout_s))
    for _, layer in synchronized_layers(model):
        layer.process_group = group
    first = dist_info.rank - dist_info.rank % group_size
    logger.info("synchronized BatchNorm reduces within groups of %d processes (this one: ranks %d-%d)",
                group_size, first, first + group_size - 1)


def distributed_data_parallel(model: nn.Module, *, device_ids: list[int] | None,
                              ddp_class: type | None = None) -> nn.Module:
    """`model` in DistributedDataParallel (`ddp_class`, default torch's, looked up when called), built with
    keywords every supported torch takes: `device_ids`, `gradient_as_bucket_view=True` (gradients are views
    into the all-reduce buckets: one copy less) and no buffer broadcast before each forward
    (no_buffer_sync_option: synchronized BN keeps the buffers equal, and with plain BN each process keeps
    its own statistics). The one place a DDP is built, so the keywords are checked against each signature
    in one test."""
    ddp_class = ddp_class or nn.parallel.DistributedDataParallel
    return ddp_class(model, device_ids=device_ids, gradient_as_bucket_view=True, **no_buffer_sync_option(ddp_class))


def no_buffer_sync_option(ddp_class: type) -> dict[str, bool]:
    """The keyword that turns off DDP's buffer broadcast before each forward, by `ddp_class`'s signature:
    `forward_sync_buffers=False` where it exists (torch 2.14 renamed it, warning about the old name),
    `broadcast_buffers=False` in older releases (torch 2.11 has only that one). ValueError if neither.
    The old keyword also skips the one copy of rank 0's buffers when DDP is built; every rank builds the
    model from the same seed or checkpoint, so the buffers are equal either way."""
    parameters = inspect.signature(ddp_class.__init__).parameters
    for name in ("forward_sync_buffers", "broadcast_buffers"):
        if name in parameters:
            return {name: False}
    raise ValueError(f"{ddp_class.__name__} takes neither forward_sync_buffers nor broadcast_buffers; "
                     f"torch {torch.__version__} is outside the supported range (see requirements.txt)")


def compile_for_training(model: nn.Module, dist_info: DistInfo, *, enabled: bool) -> nn.Module:
    """torch.compile(model) for train.compile=true (the forward; autograd compiles the backward with it).

    The synchronized BN layers compile into the model's graph, their exchange included (functional
    collectives; model/sync_batchnorm/README.md). Thread replicas (DataParallelWithCallback) cannot be
    compiled: ValueError.
    """
    if not enabled:
        return model
    if isinstance(model, DataParallelWithCallback):
        raise ValueError(f"train.compile=true cannot compile DataParallelWithCallback's thread replicas (--gpus "
                         f"{','.join(map(str, dist_info.device_ids))}); use torchrun with one process per GPU, or "
                         "train.compile=false")
    return torch.compile(model)


_COMMUNICATION_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset", "timed out",
                          "socket timeout", "broken pipe")


def is_communication_error(error: BaseException) -> bool:
    """Whether `error` says a collective failed: a peer hung past the timeout, died or is unreachable."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return is_dist() and any(marker in text for marker in _COMMUNICATION_MARKERS)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def barrier() -> None:
    """Wait for every process; no-op outside torch.distributed."""
    if is_dist():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over processes in place (no-op outside torch.distributed); returns it."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of `tensor` over processes, in place (no-op outside torch.distributed)."""
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
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
