"""Evaluate a checkpoint, from a checkout: `python eval.py --help`.

The command lives in syncseg/commands/eval.py and is installed as `syncseg-eval`; this file only runs
it, so both take the same arguments and exit with the same status.
"""
import sys

from syncseg.commands.eval import main

if __name__ == "__main__":
    sys.exit(main())
