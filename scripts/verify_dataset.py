"""Check a dataset and print its config lines, from a checkout: `python scripts/verify_dataset.py --help`.

The command lives in syncseg/commands/verify_dataset.py and is installed as `syncseg-verify`; this file only runs
it, so both take the same arguments and exit with the same status.
"""
import sys

from syncseg.commands.verify_dataset import main

if __name__ == "__main__":
    sys.exit(main())
