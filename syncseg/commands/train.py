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
import signal
import sys
from typing import Any

from syncseg.engine.cli import TIME_FORMAT, describe_error, run_command  # the standard library only

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
    """--print-config: the resolved config on stdout (0); errors are raised for run_command (2)."""
    from syncseg.engine.config import config_yaml
    from syncseg.engine.run_plan import resolved_config

    config, origin = resolved_config(args.config, args.resume, args.overrides)
    print(config_yaml(config, header=f"train.py config: {origin}; every key, defaults included"), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_config:
        return run_command("train.py", lambda: print_config(args))
    where: dict[str, Any] = {}  # filled in as the run learns its rank: who reports a bad input
    return run_command("train.py", lambda: train(args, where), reports_usage_errors=lambda: where.get("is_main", True))


def train(args: argparse.Namespace, where: dict[str, Any]) -> int:
    """The command's work; errors are raised for run_command's contract (`where["is_main"]` set once known)."""
    from syncseg.engine.distributed import cleanup, detect_launch, setup_distributed
    from syncseg.engine.launch_hints import resume_command
    from syncseg.engine.run_plan import ConfigSource, dist_timeout
    from syncseg.engine.training_run import run_training

    launch = detect_launch()
    logging.basicConfig(
        level=logging.INFO if launch.rank == 0 else logging.WARNING,
        format=f"%(asctime)s %(levelname)s{' [rank %d]' % launch.rank if launch.world_size > 1 else ''} "
               "%(name)s: %(message)s",
        datefmt=TIME_FORMAT,
    )
    from syncseg.engine.allocator import keep_freed_memory

    logger.info(keep_freed_memory())  # before the first large tensor (rank 0 logs at INFO)
    source = ConfigSource(args.config)  # read once, for the timeout and for the plan
    timeout_s = dist_timeout(source, args.resume, args.overrides)
    dist_info = setup_distributed(args.gpus, timeout_s=timeout_s, launch=launch)
    where["is_main"] = dist_info.is_main
    try:
        run = run_training(source, args.overrides, dist_info=dist_info, resume=args.resume, overwrite=args.overwrite,
                           stop_at=args.stop_at)
    except BaseException as error:
        # classified first: telling a lost peer from other errors needs the process group still up
        reported = _in_contract_terms(error, rank=dist_info.rank, timeout_s=timeout_s, launcher=launch.launcher)
        cleanup(synchronize=False)
        if reported is error:
            raise
        raise reported from error
    result = run.result
    if result.reason == "signal":
        # stopped and saved: a later SIGTERM must not cut the exit short (srun --kill-on-bad-exit sends one to
        # the other tasks as soon as the first has exited, and would turn their exit 143 into "Terminated")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if dist_info.is_main:
        if result.reason == "signal":
            print(f"train.py: stopped by {signal.Signals(result.signal).name} at iteration {result.iteration}; "
                  f"saved {run.location}/last.pt; continue with: {resume_command(args, dist_info)}",
                  file=sys.stderr)
        best = f"best val mIoU {result.best_miou:.4f}" if result.best_miou >= 0 else "no validation yet"
        logger.info("%s at iteration %d (%s); checkpoints in %s", "stopped" if result.reason != "finished" else "done",
                    result.iteration, best, run.location)
    cleanup(synchronize=result.reason != "signal")
    return 128 + result.signal if result.reason == "signal" else 0


def _in_contract_terms(error: BaseException, *, rank: int, timeout_s: float, launcher: str) -> BaseException:
    """A training failure as run_command reports it: bad input stays as it is (exit 2, rank 0 says it); a
    non-finite loss, a write that failed, a lost worker or peer become one CommandFailed line (exit 1, every
    rank says its own); anything else keeps its traceback. (A Ctrl-C before training starts is a plain
    KeyboardInterrupt; once it runs, every signal is a stop request that saves: syncseg.engine.signals.)"""
    from syncseg.engine.cli import CommandFailed
    from syncseg.engine.distributed import is_communication_error
    from syncseg.engine.launch_hints import first_line, lost_contact_message

    if isinstance(error, (ValueError, FileNotFoundError)):
        return error
    if isinstance(error, FloatingPointError):
        return CommandFailed(str(error))
    if isinstance(error, OSError):  # e.g. a full disk; the message names the file
        return CommandFailed(f"rank {rank}: {describe_error(error)}")
    if isinstance(error, RuntimeError) and "DataLoader worker" in str(error):  # e.g. the out-of-memory killer
        return CommandFailed(f"rank {rank}: {first_line(error)}; if the system ran out of memory, lower "
                             "data.num_workers or train.batch_size")
    if isinstance(error, RuntimeError) and is_communication_error(error):
        return CommandFailed(lost_contact_message(error, rank=rank, timeout_s=timeout_s, launcher=launcher))
    return error


if __name__ == "__main__":
    sys.exit(main())
