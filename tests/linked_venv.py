"""A venv that sees only some distributions of this interpreter, with what they require: linked, not installed.

    python -m tests.linked_venv .venv-sbn torch pytest

`make test-sbn` tests the sync_batchnorm wheel in such a venv (no system site-packages, nothing but torch,
pytest and their requirements), as a user with a clean venv would have it; linking the files of this
venv's torch takes a second where installing torch again writes 4.5 GB (1 min 45 s on the dev VM). The
venv has no pip: `pip --python VENV/bin/python install ...` from this interpreter installs into it.
Idempotent: an existing venv is replaced.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(names: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `names` and everything they require here (markers evaluated for this
    interpreter, extras followed, e.g. torch's cuda-toolkit[cublas,...])."""
    found: dict[str, importlib.metadata.Distribution] = {}
    followed: set[tuple[str, str]] = set()
    pending = [(name, "") for name in names]
    while pending:
        name, extra = pending.pop()
        name = _canonical(name)
        if (name, extra) in followed:
            continue
        followed.add((name, extra))
        try:
            distribution = found.get(name) or importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"linked_venv: {name} is not installed in {sys.prefix}") from None
        found[name] = distribution
        for text in distribution.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                if not extra or requirement.marker is not None and "extra" in str(requirement.marker):
                    pending += [(requirement.name, "")] + [(requirement.name, e) for e in requirement.extras]
    return found


def top_level_entries(distribution: importlib.metadata.Distribution) -> set[Path]:
    """The site-packages entries (packages, modules, .dist-info) a distribution installed; scripts and data
    outside site-packages are left out."""
    site_packages = Path(distribution.locate_file(""))
    entries = set()
    for file in distribution.files or []:
        first = Path(file).parts[0]
        if first not in ("..", "__pycache__"):
            entries.add(site_packages / first)
    return entries


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("venv", type=Path)
    parser.add_argument("distributions", nargs="+")
    args = parser.parse_args(argv)
    shutil.rmtree(args.venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(args.venv)], check=True)
    python = args.venv / "bin" / "python"
    site_packages = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        check=True, capture_output=True, text=True).stdout.strip())
    closure = requirement_closure(args.distributions)
    for entry in sorted(set().union(*(top_level_entries(d) for d in closure.values()))):
        if entry.exists():
            (site_packages / entry.name).symlink_to(entry)
    print(f"{args.venv}: {', '.join(sorted(closure))}")


if __name__ == "__main__":
    main()
