"""syncseg as a wheel beside a user's own code (issue 29 items 1-2): `pip install` of the built wheel into a
clean venv (its runtime requirements linked from this one, tests/linked_venv.py), then, from a project that
has its own data/, model/, engine/ and scripts/ packages on PYTHONPATH, the installed commands train and
evaluate with a shipped config found as package data, and `import syncseg` leaves the user's names alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.e2e.common import ROOT

# what a wheel is built from (pyproject.toml's package and its links); nothing else of the checkout
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "syncseg", "model", "data", "configs"]
RUNTIME = ["torch", "torchvision", "albumentations", "opencv-python-headless", "numpy", "pillow", "PyYAML",
           "tensorboard", "tqdm", "scipy", "safetensors", "tifffile"]
USER_PACKAGES = ["data", "model", "engine", "scripts"]
TINY = ["train.iters=4", "train.val_interval=4", "train.ckpt_interval=4", "train.log_interval=2",
        "train.batch_size=2", "train.num_vis_images=0", "data.synthetic_image_size=32", "data.crop_size=32",
        "data.synthetic_train_size=4", "data.synthetic_val_size=2", "data.num_workers=0",
        "model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1"]


def _build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:  # symlinks=True: syncseg/model etc. stay links, as in git
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("syncseg-*.whl")
    return wheel


def _user_project(folder: Path) -> None:
    """A project whose own top-level packages would shadow generic names: importing any of them fails loudly."""
    for name in USER_PACKAGES:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('the user project\\'s own {name} package was imported')\n")


@pytest.mark.slow
def test_the_wheel_installs_beside_a_project_with_its_own_data_and_model(tmp_path):
    wheel = _build_wheel(tmp_path)
    top_level = {Path(name).parts[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert top_level == {"syncseg", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert any(name == "syncseg/configs/voc.yaml" for name in zipfile.ZipFile(wheel).namelist())
    assert not any("/tests/" in name for name in zipfile.ZipFile(wheel).namelist())

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "tests.linked_venv", str(venv), *RUNTIME], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--disable-pip-version-check", "--no-index", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    project = tmp_path / "myproject"
    _user_project(project)
    environment = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(project), "HOME": str(tmp_path),
                   "SYNCSEG_NATIVE_BF16": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}

    def run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(command), cwd=project, env=environment, capture_output=True, text=True,
                              timeout=600)

    imported = run(str(venv / "bin" / "python"), "-c",
                   "import json, sys, syncseg, syncseg.engine.config, syncseg.api; "
                   "print(json.dumps([syncseg.__file__, sorted(m for m in sys.modules if m.split('.')[0] in "
                   f"{USER_PACKAGES + ['train', 'eval']!r})]))")
    assert imported.returncode == 0, imported.stderr[-3000:]
    location, user_modules = json.loads(imported.stdout)
    assert Path(location).is_relative_to(venv) and user_modules == []

    trained = run(str(venv / "bin" / "syncseg-train"), "--config", "demo.yaml", *TINY, "output_dir=run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (project / "run" / "best.pt").is_file() and (project / "run" / "last.pt").is_file()
    evaluated = run(str(venv / "bin" / "syncseg-eval"), "--checkpoint", "run/best.pt", "--device", "cpu",
                    "--no-progress", "--output", "metrics.json")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert 0.0 <= json.loads((project / "metrics.json").read_text())["miou"] <= 1.0
    helped = run(str(venv / "bin" / "syncseg-predict"), "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage:"), helped.stderr[-2000:]
    # a path still wins over a shipped name
    (project / "mine.yaml").write_text("base: demo.yaml\nname: mine\n")
    printed = run(str(venv / "bin" / "syncseg-train"), "--config", "mine.yaml", "--print-config")
    assert printed.returncode == 0 and "\nname: mine\n" in printed.stdout, printed.stderr[-2000:]
