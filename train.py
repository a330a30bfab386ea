"""Train a DeepLab segmentation model.

    python train.py --config voc.yaml [--gpus 0,1,2,3] [--resume auto|PATH] [KEY=VALUE ...]
    torchrun --nproc_per_node 4 train.py --config voc.yaml [KEY=VALUE ...]

Errors in the command line, the config or the data exit with status 2 and a one-line reason; a
non-finite loss exits with status 1; SIGINT/SIGTERM save last.pt and exit 0.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys

# The engine (torch, torchvision, albumentations) is imported after the arguments are parsed, so that
# --help and argument errors answer at once.

logger = logging.getLogger("train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train DeepLabV3/V3+ with synchronized BatchNorm (CPU, --gpus DataParallel, or torchrun DDP).",
        epilog="Example: python train.py --config voc.yaml --gpus 0,1 train.iters=200 data.root=/data/VOCdevkit/VOC2012",
    )
    parser.add_argument("--config", help="YAML file, or a name in configs/ (voc.yaml, cityscapes.yaml, demo.yaml)")
    parser.add_argument("--gpus", help="comma-separated GPU ids for one-process multi-GPU training (e.g. 0,1), "
                                       "or 'cpu'; default: GPU 0 if CUDA is available, else CPU")
    parser.add_argument("--resume", help="'auto' (continue from <run dir>/last.pt if it exists) or a checkpoint path; "
                                         "overrides apply on top of the checkpoint's config")
    parser.add_argument("--stop-at", type=int, default=None, metavar="ITER",
                        help="save last.pt and stop at this iteration (split a run into chunks; resume later)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.iters=200")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the options


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run."""
    parts = ["python", "train.py"]
    parts += ["--config", args.config] if args.config else ["--resume", args.resume or ""]
    if args.config:
        parts += ["--resume", "auto"]
    if args.gpus:
        parts += ["--gpus", args.gpus]
    return " ".join(shlex.quote(part) for part in parts + list(args.overrides))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.distributed import cleanup, setup_distributed

    try:
        dist_info = setup_distributed(args.gpus)
    except ValueError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if dist_info.is_main else logging.WARNING,
        format=f"%(asctime)s %(levelname)s{' [rank %d]' % dist_info.rank if dist_info.world_size > 1 else ''} "
               "%(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        from engine.checkpoint import resolve_training_config
        from engine.trainer import Trainer

        config, resume = resolve_training_config(args.config, args.resume, args.overrides)
        trainer = Trainer(config, dist_info, resume=resume, stop_at=args.stop_at)
        del resume
        try:
            result = trainer.fit()
        finally:
            trainer.close()
        del trainer  # the DDP wrapper must be gone before the process group (see cleanup)
    except (ValueError, FileNotFoundError) as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        cleanup(synchronize=False)
        return 2
    except FloatingPointError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        cleanup(synchronize=False)
        return 1
    if dist_info.is_main:
        if result.reason == "signal":
            print(f"train.py: interrupted at iteration {result.iteration}; saved {config.run_dir / 'last.pt'}; "
                  f"continue with: {resume_command(args)}", file=sys.stderr)
        best = f"best val mIoU {result.best_miou:.4f}" if result.best_miou >= 0 else "no validation yet"
        logger.info("done at iteration %d (%s); checkpoints in %s", result.iteration, best, config.run_dir)
    cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
