"""Lets `python scripts/<name>.py` import the application: puts the repository root on sys.path.

The one sys.path edit of the project; `python -m scripts.<name>` from the root needs none.
"""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
