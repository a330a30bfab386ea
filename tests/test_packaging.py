"""pyproject.toml: every package is installed, every console command points at a main(), no sys.path edits."""
from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


# The sync_batchnorm distribution's tests (model/sync_batchnorm/pyproject.toml): not part of any package, they
# run against the installed wheel (make test-sbn); its build leaves build/ beside them
_NOT_PACKAGES = (ROOT / "model/sync_batchnorm/tests", ROOT / "model/sync_batchnorm/build")


def _python_dirs(top: str) -> list[Path]:
    return [Path(folder) for folder, _, files in os.walk(ROOT / top)
            if any(name.endswith(".py") for name in files) and "__pycache__" not in folder
            and not any(Path(folder).is_relative_to(skipped) for skipped in _NOT_PACKAGES)]


@pytest.mark.parametrize("top", ["syncseg", "model", "data"])
def test_every_folder_with_python_files_is_a_package(top):
    """setuptools' package finder (namespaces off) skips a folder without __init__.py: an editable install
    would then leave it unimportable from outside the checkout (engine/ once had none)."""
    missing = [str(folder.relative_to(ROOT)) for folder in _python_dirs(top) if not (folder / "__init__.py").is_file()]
    assert not missing, f"folders without __init__.py: {missing}"


def test_console_commands_point_at_main_functions():
    scripts = PYPROJECT["project"]["scripts"]
    assert {"syncseg-train", "syncseg-eval", "syncseg-predict", "syncseg-export", "syncseg-verify"} <= set(scripts)
    for name, target in scripts.items():
        module_name, function = target.split(":")
        module = importlib.import_module(module_name)
        main = getattr(module, function)
        assert callable(main) and "argv" in inspect.signature(main).parameters, name


def test_no_module_edits_sys_path():
    edits = []
    for path in ROOT.glob("**/*.py"):
        if any(part in ("build", "gpu_image") or part.startswith(".venv") for part in path.relative_to(ROOT).parts):
            continue
        if re.search(r"sys\.path\.(insert|append)|sys\.path\s*=", path.read_text()):
            edits.append(str(path.relative_to(ROOT)))
    assert edits == [], edits


@pytest.mark.skipif(shutil.which("syncseg-train", path=str(Path(sys.executable).parent)) is None,
                    reason="the project is not installed in this environment (make venv runs pip install -e .)")
def test_installed_commands_run_from_any_folder(tmp_path):
    """The installed commands import the project from outside the checkout (no bootstrap, no cwd)."""
    bin_dir = Path(sys.executable).parent
    for command in ("syncseg-train", "syncseg-eval", "syncseg-predict", "syncseg-export", "syncseg-verify"):
        done = subprocess.run([str(bin_dir / command), "--help"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and "usage:" in done.stdout, (command, done.stderr[-2000:])
    done = subprocess.run([sys.executable, "-c", "import syncseg.engine.trainer, syncseg.engine.build, syncseg.commands.predict"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
