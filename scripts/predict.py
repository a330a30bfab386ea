"""Predict masks for images, from a checkout: `python scripts/predict.py --help`.

The command lives in syncseg/commands/predict.py and is installed as `syncseg-predict`; this file only runs
it, so both take the same arguments and exit with the same status.
"""
import sys

from syncseg.commands.predict import main

if __name__ == "__main__":
    sys.exit(main())
