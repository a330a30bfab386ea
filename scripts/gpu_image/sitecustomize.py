"""Rehearse the GPU image here: with this folder first on PYTHONPATH, the packages that image lacks do not import.

    PYTHONPATH=$PWD/scripts/gpu_image scripts/gpu_check.sh --dry-run OUT

Python imports `sitecustomize` at start-up; this one puts a finder first on sys.meta_path that looks for the
hidden top-level modules (scripts/gpu_wheels.py's hidden_modules(): the names in scripts/gpu_wheels.txt
the image does not have) everywhere on sys.path EXCEPT this interpreter's own site-packages, and raises
ModuleNotFoundError where it finds none. So the development venv's copies are invisible, and copies
installed elsewhere (the private folder gpu_check.sh installs the wheels into, on PYTHONPATH) import as
they would on the GPU machine. Child processes inherit PYTHONPATH, so they are hidden there too.
"""
import importlib.machinery
import importlib.util
import os
import site
import sys
from pathlib import Path


def _hidden_modules() -> frozenset:
    path = Path(__file__).resolve().parent.parent / "gpu_wheels.py"
    spec = importlib.util.spec_from_file_location("_gpu_wheels_for_sitecustomize", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return frozenset(module.hidden_modules())


class HideFromSitePackages:
    """Finds the hidden modules outside site-packages only."""

    def __init__(self, names: frozenset, site_folders: set) -> None:
        self.names = names
        self.site_folders = site_folders

    def find_spec(self, fullname, path=None, target=None):
        if "." in fullname or fullname not in self.names:
            return None  # submodules are found through their package's __path__
        elsewhere = [entry for entry in sys.path if os.path.realpath(entry or ".") not in self.site_folders]
        spec = importlib.machinery.PathFinder.find_spec(fullname, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named '{fullname}' (hidden by scripts/gpu_image/sitecustomize.py: "
                                      "the GPU image lacks it)", name=fullname)
        return spec


def _install() -> None:
    folders = set(site.getsitepackages()) | {site.getusersitepackages()}
    sys.meta_path.insert(0, HideFromSitePackages(_hidden_modules(), {os.path.realpath(f) for f in folders}))


_install()
