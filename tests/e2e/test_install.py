"""syncseg the four ways a user gets it, each in a clean venv that has only its runtime requirements (linked from
this one, tests/linked_venv.py): a wheel beside a user's own code (from a project that has its own data/,
model/, engine/ and scripts/ packages on PYTHONPATH, the installed commands train and evaluate with a shipped
config found as package data, and `import syncseg` leaves the user's names alone), an sdist, an editable
install, and a plain copy of the tree that nothing installs (docs/design.md, "One name")."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.e2e.common import ROOT

# what a wheel is built from (pyproject.toml's packages and the folders it maps); nothing else of the checkout
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "syncseg", "model", "data", "configs"]
RUNTIME = ["torch", "torchvision", "albumentations", "opencv-python-headless", "numpy", "pillow", "PyYAML",
           "tensorboard", "tqdm", "scipy", "safetensors", "tifffile"]
USER_PACKAGES = ["data", "model", "engine", "scripts"]
TINY = ["train.iters=4", "train.val_interval=4", "train.ckpt_interval=4", "train.log_interval=2",
        "train.batch_size=2", "train.num_vis_images=0", "data.synthetic_image_size=32", "data.crop_size=32",
        "data.synthetic_train_size=4", "data.synthetic_val_size=2", "data.num_workers=0",
        "model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1"]


def _copy_sources(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    return source


def _build_wheel(tmp_path: Path) -> Path:
    source = _copy_sources(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("syncseg-*.whl")
    return wheel


def top_level_info(wheel: Path) -> str:
    """The wheel's .dist-info folder, as its file names start."""
    name, version = wheel.name.split("-")[:2]
    return f"{name}-{version}.dist-info/"


def _package_files() -> set[str]:
    """What an installed syncseg holds, from the tree: syncseg/'s, model/'s (without model/sync_batchnorm's own
    tests) and data/'s modules, and configs/*.yaml, by their installed names."""
    files = set()
    for top, installed in (("syncseg", "syncseg"), ("model", "syncseg/model"), ("data", "syncseg/data")):
        for path in (ROOT / top).rglob("*.py"):
            relative = path.relative_to(ROOT / top)
            if relative.parts[:2] != ("sync_batchnorm", "tests") and "build" not in relative.parts:
                files.add(f"{installed}/{relative.as_posix()}")
    return files | {f"syncseg/configs/{path.name}" for path in (ROOT / "configs").glob("*.yaml")}


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
    assert top_level == {"syncseg", top_level_info(wheel).rstrip("/")}
    assert any(name == "syncseg/configs/voc.yaml" for name in zipfile.ZipFile(wheel).namelist())
    assert not any("/tests/" in name for name in zipfile.ZipFile(wheel).namelist())
    assert {name for name in zipfile.ZipFile(wheel).namelist() if not name.startswith(top_level_info(wheel))} \
        == _package_files()

    venv = _venv(tmp_path)
    _pip_install(venv, str(wheel))
    project = tmp_path / "myproject"
    _user_project(project)
    environment = {**_environment(tmp_path, venv), "PYTHONPATH": str(project)}

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
    listed = run(str(venv / "bin" / "python"), "-m", "syncseg", "--help")
    assert listed.returncode == 0 and "prepare-voc" in listed.stdout, listed.stderr[-2000:]
    # a path still wins over a shipped name
    (project / "mine.yaml").write_text("base: demo.yaml\nname: mine\n")
    printed = run(str(venv / "bin" / "syncseg-train"), "--config", "mine.yaml", "--print-config")
    assert printed.returncode == 0 and "\nname: mine\n" in printed.stdout, printed.stderr[-2000:]


def _venv(tmp_path: Path, *extra: str) -> Path:
    """A venv with syncseg's runtime requirements (and `extra` distributions) linked from this one, no syncseg."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "tests.linked_venv", str(venv), *RUNTIME, *extra], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    return venv


def _pip_install(venv: Path, *arguments: str) -> None:
    """pip install, from this interpreter's pip into `venv`, offline and without dependencies (they are linked)."""
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--disable-pip-version-check", "--no-index", "--no-deps", *arguments],
                   check=True, capture_output=True, timeout=300)


def _environment(tmp_path: Path, venv: Path) -> dict[str, str]:
    """What a user's shell gives: the venv's commands, no PYTHONPATH."""
    return {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "SYNCSEG_NATIVE_BF16": "0",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


# where a process's syncseg, syncseg.model.sync_batchnorm, syncseg.data and shipped configs come from
WHERE = ("import json, syncseg, syncseg.model.sync_batchnorm, syncseg.data.folder; "
         "from syncseg.engine.config import CONFIG_DIR; "
         "print(json.dumps([syncseg.__file__, syncseg.model.sync_batchnorm.__file__, syncseg.data.folder.__file__, "
         "str(CONFIG_DIR), sorted(p.name for p in CONFIG_DIR.glob('*.yaml'))]))")
CONFIGS = sorted(path.name for path in (ROOT / "configs").glob("*.yaml"))


def _where(python: Path, cwd: Path, environment: dict[str, str]) -> list:
    process = subprocess.run([str(python), "-c", WHERE], cwd=cwd, env=environment, capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout)


def _python_m_syncseg(python: Path, cwd: Path, environment: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "syncseg", *args], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_the_sdist_holds_the_folders_and_installs_the_same_package(tmp_path):
    source = _copy_sources(tmp_path)
    built = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path / "dist")],
                           cwd=source, check=True, capture_output=True, text=True, timeout=300)
    sdist = tmp_path / "dist" / built.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for name in ("pyproject.toml", "model/sync_batchnorm/batchnorm.py", "data/folder.py", "configs/voc.yaml",
                 "syncseg/layout.py", "syncseg/__main__.py"):
        assert name in names, name
    venv = _venv(tmp_path, "setuptools")
    _pip_install(venv, "--no-build-isolation", str(sdist))
    project = tmp_path / "myproject"
    _user_project(project)
    environment = {**_environment(tmp_path, venv), "PYTHONPATH": str(project)}
    package, sync_batchnorm, folder, configs, shipped = _where(venv / "bin" / "python", project, environment)
    site_packages = Path(package).parent.parent
    assert site_packages.is_relative_to(venv) and site_packages.name == "site-packages"
    assert Path(sync_batchnorm) == site_packages / "syncseg/model/sync_batchnorm/__init__.py"
    assert Path(folder) == site_packages / "syncseg/data/folder.py"
    assert Path(configs) == site_packages / "syncseg/configs" and shipped == CONFIGS
    printed = _python_m_syncseg(venv / "bin" / "python", project, environment, "train", "--config", "voc.yaml",
                                "--print-config")
    assert printed.returncode == 0 and "\nname: voc_deeplabv3plus_r101\n" in printed.stdout, printed.stderr[-2000:]


@pytest.mark.slow
def test_an_editable_install_maps_the_checkouts_folders(tmp_path):
    source = _copy_sources(tmp_path)
    venv = _venv(tmp_path, "setuptools")
    _pip_install(venv, "--no-build-isolation", "-e", str(source))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    environment = _environment(tmp_path, venv)
    package, sync_batchnorm, folder, configs, shipped = _where(venv / "bin" / "python", elsewhere, environment)
    assert Path(package) == source / "syncseg/__init__.py"
    assert Path(sync_batchnorm) == source / "model/sync_batchnorm/__init__.py"
    assert Path(folder) == source / "data/folder.py"
    assert Path(configs) == source / "configs" and shipped == CONFIGS
    # an edit in the checkout is what the installed command runs
    (source / "configs" / "mine.yaml").write_text("base: demo.yaml\nname: edited\n")
    printed = subprocess.run([str(venv / "bin" / "syncseg-train"), "--config", "mine", "--print-config"],
                             cwd=elsewhere, env=environment, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0 and "\nname: edited\n" in printed.stdout, printed.stderr[-2000:]


def _checkout_copy(tmp_path: Path) -> Path:
    """The tree as git would check it out (tracked and new files, without the ignored ones): no install, no links."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True, text=True, timeout=60).stdout.split("\0")
    checkout = tmp_path / "checkout"
    for name in filter(None, listed):
        if (ROOT / name).is_file() and not (ROOT / name).is_symlink():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    return checkout


@pytest.mark.slow
def test_a_plain_checkout_runs_its_commands_without_an_install(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    checkout = _checkout_copy(tmp_path)
    venv = _venv(tmp_path)
    environment = _environment(tmp_path, venv)
    python = venv / "bin" / "python"
    package, sync_batchnorm, folder, configs, shipped = _where(python, checkout, environment)
    assert Path(package) == checkout / "syncseg/__init__.py"
    assert Path(sync_batchnorm) == checkout / "model/sync_batchnorm/__init__.py"
    assert Path(folder) == checkout / "data/folder.py" and Path(configs) == checkout / "configs"
    assert shipped == CONFIGS

    listed = _python_m_syncseg(python, checkout, environment, "--help")
    assert listed.returncode == 0 and listed.stdout.startswith("usage: python -m syncseg <command>"), listed.stderr
    unknown = _python_m_syncseg(python, checkout, environment, "pridict")
    assert unknown.returncode == 2 and "unknown command 'pridict'" in unknown.stderr
    trained = subprocess.run([str(python), "train.py", "--config", "demo.yaml", *TINY, "output_dir=run"],
                             cwd=checkout, env=environment, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    image = checkout / "image.png"
    subprocess.run([str(python), "-c", "import sys, numpy, PIL.Image; "
                    "PIL.Image.fromarray(numpy.zeros((24, 32, 3), numpy.uint8)).save(sys.argv[1])", str(image)],
                   check=True, env=environment, timeout=120)
    predicted = _python_m_syncseg(python, checkout, environment, "predict", "--checkpoint", "run/best.pt",
                                  "--input", str(image), "--output", "masks", "--device", "cpu")
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert (checkout / "masks" / "image_mask.png").is_file()
    evaluated = _python_m_syncseg(python, checkout, environment, "eval", "--checkpoint", "run/best.pt", "--device",
                                  "cpu", "--no-progress", "--output", "metrics.json")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert 0.0 <= json.loads((checkout / "metrics.json").read_text())["miou"] <= 1.0

    # this project's own venv holds an editable install of ROOT: at the copy's top, the copy is what runs
    assert _where(Path(sys.executable), checkout, {**os.environ, "PYTHONPATH": ""})[:3] == [package, sync_batchnorm,
                                                                                          folder]
