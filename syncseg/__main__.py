"""`python -m syncseg <command> [arguments]`: every command line, from a checkout's top or installed.

Each command is the same `main` as its installed `syncseg-<command>` console script (and, for train and eval,
the checkout's `python train.py` / `python eval.py`): the same arguments, the same exit status. Only the
chosen command's module is imported. Under torchrun: `torchrun --nproc-per-node 4 -m syncseg train ...`.
"""
from __future__ import annotations

import importlib
import sys

# command -> (module in syncseg.commands, what it does)
COMMANDS = {
    "train": ("train", "train a DeepLab model from a config (resumable; torchrun, Slurm, --gpus)"),
    "eval": ("eval", "evaluate a checkpoint on its config's validation set (mIoU, per-class table)"),
    "predict": ("predict", "predict masks for an image or a folder of images with a checkpoint"),
    "export": ("export", "a checkpoint as ONNX, torch.export, TorchScript or safetensors, checked against PyTorch"),
    "verify": ("verify_dataset", "check a data set against its config, one line per problem"),
    "prepare-voc": ("prepare_voc", "build VOC 2012 + SBD's trainaug split from the two downloads"),
}
PROGRAM = "python -m syncseg"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROGRAM} <command> [arguments]   ({PROGRAM} <command> --help for a command's own)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command named by argv[0] with the rest of argv; exit status 2 for a missing or unknown one."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, arguments = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{PROGRAM}: unknown command '{name}'; expected one of {', '.join(COMMANDS)}\n\n{usage()}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"syncseg.commands.{COMMANDS[name][0]}")
    sys.argv = [f"{PROGRAM} {name}", *arguments]  # argparse's usage line names the command as typed
    return module.main(arguments)


if __name__ == "__main__":
    sys.exit(main())
