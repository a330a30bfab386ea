"""Train a DeepLab segmentation model.

    python train.py --config voc.yaml [--gpus 0,1,2,3] [--resume auto|PATH] [--overwrite] [KEY=VALUE ...]
    torchrun --nproc_per_node 4 train.py --config voc.yaml [KEY=VALUE ...]
    srun python train.py --config voc.yaml ...   (one task per GPU; ranks from SLURM_*)

Exit status (the contract and the error line's form: syncseg/engine/cli.py): 0 when train.iters (or --stop-at)
is reached; 2 for errors in the command line, the config, the data or the run dir (one line); 1 when
training fails (a non-finite loss or weight, a checkpoint that cannot be written, a peer process that
hung or vanished); 128 + the signal number (130 for SIGINT, 143 for SIGTERM) after a signal stopped
the run and last.pt was saved.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from syncseg.engine.cli import TIME_FORMAT, describe_error, print_error  # the standard library only

# The engine (torch, torchvision, albumentations) is imported after the arguments are parsed, so that
# --help and argument errors answer at once.

logger = logging.getLogger("train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train DeepLabV3/V3+ with synchronized BatchNorm (CPU, --gpus DataParallel, torchrun or srun DDP).",
        epilog="Example: python train.py --config voc.yaml --gpus 0,1 train.iters=200 data.root=/data/VOCdevkit/VOC2012",
    )
    parser.add_argument("--config", help="YAML file, or a name in configs/ (voc.yaml, cityscapes.yaml, demo.yaml)")
    parser.add_argument("--gpus", help="comma-separated GPU ids for one-process multi-GPU training (e.g. 0,1), "
                                       "or 'cpu'; default: GPU 0 if CUDA is available, else CPU")
    parser.add_argument("--resume", help="'auto' (continue from <run dir>/last.pt if it exists) or a checkpoint path; "
                                         "KEY=VALUE overrides apply on top of the checkpoint's config. Under "
                                         "torchelastic (torchrun) an existing last.pt is always resumed")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in a run dir that holds a run, deleting its last.pt and best.pt")
    parser.add_argument("--stop-at", type=int, default=None, metavar="ITER",
                        help="save last.pt and stop at this iteration (split a run into chunks; resume later)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the config this command would train with (the --config file, its base chain "
                             "and the overrides, every other key at its default; a resumed checkpoint's config "
                             "when resuming) as YAML, usable as --config, and exit")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.iters=200")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the options


def print_config(args: argparse.Namespace) -> int:
    """--print-config: the resolved config on stdout (0), or the error in one line (2)."""
    from syncseg.engine.config import config_yaml
    from syncseg.engine.run_plan import resolved_config

    try:
        config, origin = resolved_config(args.config, args.resume, args.overrides)
    except (ValueError, FileNotFoundError) as error:
        print_error("train.py", describe_error(error))
        return 2
    print(config_yaml(config, header=f"train.py config: {origin}; every key, defaults included"), end="")
    return 0


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


def resume_command(args: argparse.Namespace, dist_info, *, parent: int | None = None) -> str:
    """The command line that continues this run, in the form it was launched in: under torchrun the
    agent's own command (its --nnodes, min:max for an elastic launch, and rendezvous options; the run
    dir's last.pt is resumed by itself there), otherwise train.py's arguments with --resume auto."""
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_config:
        return print_config(args)
    from syncseg.engine.distributed import cleanup, detect_launch, is_communication_error, setup_distributed
    from syncseg.engine.run_plan import dist_timeout, plan_run
    from syncseg.engine.trainer import Trainer

    try:
        launch = detect_launch()
    except ValueError as error:
        print_error("train.py", describe_error(error))
        return 2
    logging.basicConfig(
        level=logging.INFO if launch.rank == 0 else logging.WARNING,
        format=f"%(asctime)s %(levelname)s{' [rank %d]' % launch.rank if launch.world_size > 1 else ''} "
               "%(name)s: %(message)s",
        datefmt=TIME_FORMAT,
    )
    try:
        timeout_s = dist_timeout(args.config, args.resume, args.overrides)
        dist_info = setup_distributed(args.gpus, timeout_s=timeout_s, launch=launch)
    except (ValueError, FileNotFoundError) as error:
        print_error("train.py", describe_error(error))
        return 2
    plan = trainer = result = None
    code = 0
    try:
        plan = plan_run(args.config, args.resume, args.overrides, dist_info=dist_info, overwrite=args.overwrite)
        trainer = Trainer.from_config(plan.config, dist_info, resume=plan.resume, run_id=plan.run_id,
                                      overrides=plan.overrides)
        plan.resume = None  # the payload's tensors are in the model and optimizer now
        result = trainer.fit(stop_at=args.stop_at)
    except (ValueError, FileNotFoundError) as error:
        code, message = 2, describe_error(error)
    except FloatingPointError as error:
        code, message = 1, str(error)
    except KeyboardInterrupt:
        code, message = 128 + signal.SIGINT, "interrupted a second time; stopped without saving"
    except OSError as error:  # e.g. a full disk; the message names the file
        code, message = 1, f"rank {dist_info.rank}: {describe_error(error)}"
    except RuntimeError as error:
        if "DataLoader worker" in str(error):  # e.g. killed by the kernel's out-of-memory killer
            code, message = 1, (f"rank {dist_info.rank}: {first_line(error)}; if the system ran "
                                "out of memory, lower data.num_workers or train.batch_size")
        elif not is_communication_error(error):
            raise
        else:
            code, message = 1, lost_contact_message(error, rank=dist_info.rank, timeout_s=timeout_s,
                                                    launcher=dist_info.launch.launcher)
    finally:
        if trainer is not None:
            trainer.close()  # stops the data-loading workers, which ignore SIGINT/SIGTERM
        trainer = None  # the DDP wrapper must be gone before the process group (see cleanup)
        if plan is not None:
            plan.release()
    if result is not None and result.reason == "signal":
        # stopped and saved: a later SIGTERM must not cut the exit short (srun --kill-on-bad-exit sends one to
        # the other tasks as soon as the first has exited, and would turn their exit 143 into "Terminated")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if code:
        if dist_info.is_main or code == 1:
            print_error("train.py", message)
        cleanup(synchronize=False)
        return code
    if dist_info.is_main:
        last = plan.config.run_dir / "last.pt"
        if result.reason == "signal":
            print(f"train.py: stopped by {signal.Signals(result.signal).name} at iteration {result.iteration}; "
                  f"saved {last}; continue with: {resume_command(args, dist_info)}", file=sys.stderr)
        best = f"best val mIoU {result.best_miou:.4f}" if result.best_miou >= 0 else "no validation yet"
        logger.info("%s at iteration %d (%s); checkpoints in %s", "stopped" if result.reason != "finished" else "done",
                    result.iteration, best, plan.config.run_dir)
    cleanup(synchronize=result.reason != "signal")
    return 128 + result.signal if result.reason == "signal" else 0


if __name__ == "__main__":
    sys.exit(main())
