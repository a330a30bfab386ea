"""Train a DeepLab segmentation model, from a checkout: `python train.py --help`.

The command lives in syncseg/commands/train.py and is installed as `syncseg-train`; this file only runs
it, so both take the same arguments and exit with the same status.
"""
import sys

from syncseg.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
