"""Export a checkpoint (ONNX, TorchScript, torch.export, safetensors), from a checkout: `python scripts/export.py --help`.

The command lives in syncseg/commands/export.py and is installed as `syncseg-export`; this file only runs
it, so both take the same arguments and exit with the same status.
"""
import sys

from syncseg.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
