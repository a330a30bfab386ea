"""Prepare VOC + SBD (train_aug), from a checkout: `python scripts/prepare_voc.py --help`.

The command lives in syncseg/commands/prepare_voc.py and is installed as `syncseg-prepare-voc`; this file only runs
it, so both take the same arguments and exit with the same status.
"""
import sys

from syncseg.commands.prepare_voc import main

if __name__ == "__main__":
    sys.exit(main())
