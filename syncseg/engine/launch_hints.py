"""What to tell the user about the launcher a run came from: the command line that continues a stopped run
(torchrun's own, srun's or python's), and the line for a peer process that was lost.

Standard library only: train.py's messages need no torch.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any


def _interpreter() -> str:
    """The running interpreter, relative to the working directory when inside it (.venv/bin/python)."""
    relative = os.path.relpath(sys.executable)
    return relative if not relative.startswith("..") else sys.executable


def launcher_command(pid: int) -> list[str] | None:
    """The torchrun command line of process `pid` (the agent that started this worker), or None when that
    process is not torchrun or its command line cannot be read."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return None
    for index, part in enumerate(argv[:3]):
        if Path(part).name == "torchrun" or (part == "torch.distributed.run" and argv[index - 1:index] == ["-m"]):
            return argv
    return None


def resume_command(args: Any, dist_info: Any, *, parent: int | None = None) -> str:
    """The command line that continues this run, in the form it was launched in: under torchrun the
    agent's own command (its --nnodes, min:max for an elastic launch, and rendezvous options; the run
    dir's last.pt is resumed by itself there), otherwise train.py's arguments with --resume auto. `args`:
    train.py's parsed arguments (config, resume, gpus, overrides); `dist_info`: the run's DistInfo."""
    launch = dist_info.launch
    if launch.launcher == "torchrun":
        agent = launcher_command(os.getppid() if parent is None else parent)
        if agent is not None:
            agent[0] = _interpreter() if Path(agent[0]).name.startswith("python") else agent[0]
            prefix = "srun " if "SLURM_STEP_ID" in os.environ else ""
            return prefix + " ".join(shlex.quote(part) for part in agent)
    parts = ["--config", args.config, "--resume", "auto"] if args.config else ["--resume", args.resume or ""]
    if args.gpus:
        parts += ["--gpus", args.gpus]
    tail = " ".join(shlex.quote(part) for part in ["train.py", *parts, *args.overrides])
    if launch.launcher == "torchrun":
        nodes = f"--nnodes {launch.num_nodes} " if launch.num_nodes > 1 else ""
        rendezvous = "<the same rendezvous options> " if launch.num_nodes > 1 else ""
        return (f"{shlex.quote(_interpreter())} -m torch.distributed.run {nodes}--nproc_per_node "
                f"{launch.local_world_size} {rendezvous}{tail}")
    if launch.launcher == "slurm":
        return f"srun {shlex.quote(_interpreter())} {tail}"
    return f"{shlex.quote(_interpreter())} {tail}"


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, whole (its type's name when the message is empty)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def lost_contact_message(error: BaseException, *, rank: int, timeout_s: float, launcher: str) -> str:
    """The line for a collective that failed because a peer hung, died or became unreachable: the
    backend's own first line, whole, and what brings the run back under this launcher."""
    again = {
        "torchrun": "Under torchrun --max-restarts the job restarts and resumes from last.pt",
        "slurm": "Requeue the job (scontrol requeue $SLURM_JOB_ID; scripts/slurm/train.sbatch does it by itself) "
                 "and it resumes from last.pt with --resume auto",
    }.get(launcher, "Start the same command with --resume auto to continue from last.pt")
    return (f"rank {rank}: lost contact with the other processes; a peer hung, was killed or became unreachable, "
            f"and collectives wait at most dist.timeout_s={timeout_s:g} s. {again}. The backend said: {first_line(error)}")
