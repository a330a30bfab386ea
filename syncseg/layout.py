"""Where the package's parts live: `syncseg.model`, `syncseg.data` and the shipped configs.

The repository keeps `model/`, `data/` and `configs/` as top-level folders beside `syncseg/` (no links).
An installed package holds them inside it (pyproject.toml maps `syncseg.model` to `model/`, `syncseg.data` to
`data/` and copies `configs/*.yaml` to `syncseg/configs/`; an editable install maps the same folders with
setuptools' own finder). A checkout that is not installed (`python train.py`, `python -m syncseg` from its
top) gets the same mapping from `CheckoutFinder`, which `syncseg/__init__.py` puts first on `sys.meta_path`
only when the package sits in such a checkout. Standard library only: the config schema imports this.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# subpackages that a checkout keeps at its top rather than inside syncseg/
TOP_LEVEL_PACKAGES = ("model", "data")


def checkout_root() -> Path | None:
    """The checkout that holds this package beside its top-level `model/` and `data/`, or None where the
    package holds them itself (a wheel or an sdist's install)."""
    if all((PACKAGE_DIR / name).is_dir() for name in TOP_LEVEL_PACKAGES):
        return None
    root = PACKAGE_DIR.parent
    if all((root / name / "__init__.py").is_file() for name in TOP_LEVEL_PACKAGES):
        return root
    missing = [name for name in TOP_LEVEL_PACKAGES if not (root / name / "__init__.py").is_file()]
    raise ImportError(f"syncseg at '{PACKAGE_DIR}' has neither its subpackages "
                      f"{', '.join(TOP_LEVEL_PACKAGES)} inside it (an installed package) nor beside it in a "
                      f"checkout ('{root}' lacks {', '.join(f'{name}/__init__.py' for name in missing)}); "
                      "reinstall syncseg or check out the whole repository")


def config_dir() -> Path:
    """The folder of the shipped configs (demo.yaml, voc.yaml, ...): `syncseg/configs` installed, the
    checkout's top-level `configs/` otherwise."""
    inside = PACKAGE_DIR / "configs"
    root = None if inside.is_dir() else checkout_root()
    return inside if root is None else root / "configs"


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds `syncseg.model` and `syncseg.data` in a checkout's top-level folders; their submodules follow
    from the packages' own `__path__`."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __package__ or name not in TOP_LEVEL_PACKAGES:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(self.root)])

    def __repr__(self) -> str:
        return f"CheckoutFinder({str(self.root)!r})"


def install_checkout_finder() -> None:
    """In a checkout, map `syncseg.model` / `syncseg.data` to its top-level folders (once per process). First on
    `sys.meta_path`, so that an editable install of another checkout cannot hand this one its folders."""
    root = checkout_root()
    if root is None or any(isinstance(finder, CheckoutFinder) and finder.root == root for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, CheckoutFinder(root))
