"""The tree has no links, and its folders are the package `syncseg` (syncseg/layout.py, docs/design.md "One name"):
pyproject.toml lists every package, and a checkout maps `syncseg.model` / `syncseg.data` to its top-level
folders and nothing else. Installing and running a copy of the tree: tests/e2e/test_install.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

import syncseg.layout as layout
from syncseg.layout import CheckoutFinder, checkout_root, config_dir

ROOT = Path(__file__).resolve().parents[1]
# where model/sync_batchnorm's own distribution keeps what is not part of syncseg
NOT_PACKAGES = (ROOT / "model/sync_batchnorm/tests", ROOT / "model/sync_batchnorm/build")


def _git(*args: str) -> str:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True, timeout=60).stdout


def test_no_tracked_file_is_a_link():
    links = [line for line in _git("ls-files", "-s").splitlines() if line.startswith("120000")]
    assert links == []


def test_no_link_in_the_packages_folders():
    found = []
    for top in ("syncseg", "model", "data", "configs", "scripts", "benchmarks", "docs", "tests"):
        for folder, names, files in os.walk(ROOT / top):
            found += [str(Path(folder, name).relative_to(ROOT)) for name in names + files
                      if Path(folder, name).is_symlink()]
    assert found == []


def _tree_packages() -> set[str]:
    """Every folder with an __init__.py that installs as a package of syncseg, by its dotted name."""
    packages = {"syncseg.configs"}
    for top, prefix in (("syncseg", "syncseg"), ("model", "syncseg.model"), ("data", "syncseg.data")):
        for init in (ROOT / top).rglob("__init__.py"):
            folder = init.parent
            if not any(folder.is_relative_to(skipped) for skipped in NOT_PACKAGES):
                packages.add(".".join([prefix, *folder.relative_to(ROOT / top).parts]))
    return packages


def test_pyproject_lists_every_package_and_maps_the_top_level_folders():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _tree_packages()
    assert setuptools["package-dir"] == {"syncseg": "syncseg", "syncseg.model": "model", "syncseg.data": "data",
                                         "syncseg.configs": "configs"}
    assert setuptools["package-data"] == {"syncseg.configs": ["*.yaml"]}
    assert sorted(path.name for path in (ROOT / "configs").iterdir()) == sorted(
        path.name for path in (ROOT / "configs").glob("*.yaml"))  # package data: nothing else is shipped


def test_this_checkout_is_the_package():
    import syncseg.data.folder
    import syncseg.model.sync_batchnorm

    assert checkout_root() == ROOT
    assert Path(syncseg.model.sync_batchnorm.__file__) == ROOT / "model/sync_batchnorm/__init__.py"
    assert Path(syncseg.data.folder.__file__) == ROOT / "data/folder.py"
    assert config_dir() == ROOT / "configs" and (config_dir() / "demo.yaml").is_file()


def test_the_checkout_finder_maps_its_two_folders_only():
    finder = CheckoutFinder(ROOT)
    assert Path(finder.find_spec("syncseg.model").origin) == ROOT / "model/__init__.py"
    assert Path(finder.find_spec("syncseg.data").origin) == ROOT / "data/__init__.py"
    # the other top-level files and folders of a checkout are not part of the package
    for name in ("syncseg.train", "syncseg.scripts", "syncseg.tests", "syncseg.configs", "model", "data",
                 "syncseg.model.deeplab"):
        assert finder.find_spec(name) is None, name


def test_an_installed_layout_needs_no_finder_and_a_broken_one_is_named(tmp_path, monkeypatch):
    installed = tmp_path / "site" / "syncseg"
    for name in ("model", "data", "configs"):
        (installed / name).mkdir(parents=True)
    monkeypatch.setattr(layout, "PACKAGE_DIR", installed)
    assert checkout_root() is None and config_dir() == installed / "configs"

    partial = tmp_path / "partial"
    (partial / "syncseg").mkdir(parents=True)
    (partial / "model").mkdir()
    (partial / "model" / "__init__.py").write_text("")
    monkeypatch.setattr(layout, "PACKAGE_DIR", partial / "syncseg")
    with pytest.raises(ImportError, match=r"'.*partial' lacks data/__init__\.py"):
        checkout_root()
