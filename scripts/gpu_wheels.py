"""Wheels for the borrowed GPU image: what syncseg needs there and the image lacks, for offline installs.

    python scripts/gpu_wheels.py [--python-version 3.12] [DIR]      (DIR: .gpu_wheels in the repository root)
    python scripts/gpu_wheels.py --check-only [DIR]

Run it where PyPI is reachable, right before borrowing the GPU machine. It downloads the wheels pinned in
scripts/gpu_wheels.txt (hash-checked, CPython 3.12 manylinux x86-64 or pure Python, no dependency
resolution) into DIR, replacing what DIR held, and checks the folder before reporting success:
  - one wheel per pinned name, at the pinned version, each installable on CPython 3.12 / manylinux x86-64
    (glibc 2.28 or older);
  - every Requires-Dist of every wheel (markers evaluated for that interpreter, no extras) is met by a
    wheel in DIR or is one of the packages the image has (IMAGE_HAS);
  - pip installs the folder offline into an empty target as it would for that interpreter
    (--no-index --no-deps --only-binary=:all: --python-version --platform).
scripts/gpu_check.sh installs DIR, offline, into a private folder when an import fails on the GPU machine.
DIR must reach that machine: the device tool copies tracked files and untracked files git does not ignore;
DIR is added to .git/info/exclude (so it is never committed), so name it in the call's `carry`.
Exit status: 0 folder ready, 1 the folder failed a check, 2 usage error, 3 the registry could not be
reached (nothing was replaced).
"""
from __future__ import annotations

import argparse
import email.parser
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "scripts" / "gpu_wheels.txt"
DEFAULT_DIR = ROOT / ".gpu_wheels"
# Distributions the GPU image has (as described for it; versions unknown unless pinned by it), by their
# normalized names. A wheel's requirement on one of these is met by the image. typing-extensions is
# here too, yet pinned in gpu_wheels.txt: the image's may be older than pydantic needs.
IMAGE_HAS = frozenset({
    "torch", "torchvision", "numpy", "scipy", "opencv-python-headless", "pillow", "pyyaml", "tqdm", "tensorboard",
    "timm", "safetensors", "onnx", "onnxruntime", "pytest", "pytest-timeout", "typing-extensions", "packaging",
    "huggingface-hub",
})
PYTHON_VERSION = "3.12"
MANYLINUX = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# what pip prints when it cannot reach the index (exit status 3 instead of 1)
UNREACHABLE = ("Failed to establish a new connection", "NewConnectionError", "Temporary failure in name resolution",
               "Network is unreachable", "ConnectTimeout", "Read timed out", "ProxyError", "No route to host")
MAX_FOLDER_BYTES = 32 * 2**20  # the device tool carries 64 MiB in all; the wheels are ~8 MiB


def _packaging():
    """(requirements, tags, utils) of packaging: the installed package, else the copy vendored in pip."""
    try:
        from packaging import requirements, tags, utils
    except ImportError:  # pragma: no cover - depends on the interpreter
        from pip._vendor.packaging import requirements, tags, utils
    return requirements, tags, utils


def normalize(name: str) -> str:
    """PEP 503's normalized distribution name (no packaging import: sitecustomize calls this at start-up)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(requirements_file: Path = REQUIREMENTS) -> dict[str, str]:
    """{normalized name: version} of the `name==version --hash=...` lines."""
    pins = {}
    for line in requirements_file.read_text().splitlines():
        spec = line.split("#", 1)[0].split("--hash", 1)[0].strip()
        if spec:
            name, _, version = spec.partition("==")
            if not version:
                raise ValueError(f"{requirements_file}: '{spec}' is not pinned as name==version")
            pins[normalize(name)] = version.strip()
    return pins


def hidden_modules(requirements_file: Path = REQUIREMENTS) -> list[str]:
    """Top-level modules the image lacks: the pinned names it does not have (all of them import under
    their distribution name with '_' for '-'). scripts/gpu_image/sitecustomize.py hides exactly these."""
    return sorted(name.replace("-", "_") for name in pinned(requirements_file) if name not in IMAGE_HAS)


def _environment(python_version: str) -> dict[str, str]:
    return {"python_version": python_version, "python_full_version": f"{python_version}.0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _supported_tags(python_version: str) -> set:
    tags = _packaging()[1]
    interpreter = "cp" + python_version.replace(".", "")
    return set(tags.cpython_tags(tuple(int(p) for p in python_version.split(".")), platforms=MANYLINUX)) | set(
        tags.compatible_tags(tuple(int(p) for p in python_version.split(".")), interpreter=interpreter,
                             platforms=MANYLINUX))


def wheel_metadata(path: Path):
    """(METADATA message, top-level module names) of a wheel file."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        metadata_name = next(n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(archive.read(metadata_name).decode("utf-8"))
    modules = set()
    for name in names:
        first, _, rest = name.partition("/")
        if first.endswith((".dist-info", ".data")):
            continue
        if rest:  # a package folder; `x.libs` folders hold shared libraries, not modules
            if "." not in first:
                modules.add(first)
        elif first.endswith((".py", ".so")):
            modules.add(first.split(".", 1)[0])
    return message, modules


def check(folder: Path, *, python_version: str = PYTHON_VERSION, pins: dict[str, str] | None = None) -> list[str]:
    """Everything wrong with `folder` as the wheel set for the image (empty: ready)."""
    requirements, _, utils = _packaging()
    pins = pinned() if pins is None else pins
    problems = []
    wheels = sorted(folder.glob("*.whl"))
    others = sorted(p.name for p in folder.iterdir() if p.suffix != ".whl") if folder.is_dir() else []
    if not folder.is_dir() or not wheels:
        return [f"{folder} holds no wheels"]
    if others:
        problems.append(f"{folder} holds files other than wheels: {', '.join(others)}")
    supported = _supported_tags(python_version)
    found: dict[str, tuple[str, Path]] = {}
    for wheel in wheels:
        name, version, _, wheel_tags = utils.parse_wheel_filename(wheel.name)
        if name in found:
            problems.append(f"two wheels of {name}: {found[name][1].name} and {wheel.name} (pip would stop)")
        found[name] = (str(version), wheel)
        if not wheel_tags & supported:
            problems.append(f"{wheel.name} does not install on CPython {python_version} manylinux x86-64")
    for name, version in pins.items():
        if name not in found:
            problems.append(f"{name}=={version} (scripts/gpu_wheels.txt) has no wheel in {folder}")
        elif found[name][0] != version:
            problems.append(f"{found[name][1].name} is not the pinned {name}=={version}")
    for name in sorted(set(found) - set(pins)):
        problems.append(f"{found[name][1].name} is not in scripts/gpu_wheels.txt")
    environment = _environment(python_version)
    for name, (version, wheel) in sorted(found.items()):
        message, modules = wheel_metadata(wheel)
        expected_module = name.replace("-", "_")
        if name not in IMAGE_HAS and expected_module not in modules:
            problems.append(f"{wheel.name} has no top-level module {expected_module} (it has {sorted(modules)}); "
                            "hidden_modules() assumes one")
        for line in message.get_all("Requires-Dist") or []:
            requirement = requirements.Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            needed = normalize(requirement.name)
            if needed in found:
                if not requirement.specifier.contains(found[needed][0], prereleases=True):
                    problems.append(f"{name} {version} needs {line}; {folder} has {needed} {found[needed][0]}")
            elif needed not in IMAGE_HAS:
                problems.append(f"{name} {version} needs {line}: neither in {folder} nor in the image "
                                "(add it to scripts/gpu_wheels.txt)")
    return problems


def pip_offline_install(folder: Path, target: Path, *, python_version: str = PYTHON_VERSION,
                        python: str = sys.executable) -> subprocess.CompletedProcess:
    """pip installs every wheel of `folder` into `target` as for CPython `python_version` / manylinux
    x86-64, without an index (what the GPU machine does, less the import)."""
    platforms = [arg for platform in MANYLINUX for arg in ("--platform", platform)]
    command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index", "--no-deps",
               "--no-compile", "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
               *platforms, "--target", str(target), *map(str, sorted(folder.glob("*.whl")))]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"},
                          timeout=300)


def download(dest: Path, *, python_version: str = PYTHON_VERSION) -> subprocess.CompletedProcess:
    platforms = [arg for platform in MANYLINUX for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", *platforms,
               "--timeout", "30", "--retries", "2", "--require-hashes", "-r", str(REQUIREMENTS), "-d", str(dest)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def _replaceable(folder: Path) -> bool:
    """True when `folder` is absent or holds wheels alone (safe to replace)."""
    return not folder.exists() or (folder.is_dir() and all(p.suffix == ".whl" for p in folder.iterdir()))


def _exclude_from_git(folder: Path) -> str | None:
    """Add `folder` to .git/info/exclude when it lies inside this repository's work tree (never
    committed; the device tool then carries it only when a call names it in `carry`)."""
    try:
        relative = folder.resolve().relative_to(ROOT)
    except ValueError:
        return None
    exclude = ROOT / ".git" / "info" / "exclude"
    if not (ROOT / ".git").is_dir():
        return None
    line = f"/{relative.as_posix()}/"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    existing = exclude.read_text().splitlines() if exclude.exists() else []
    if line not in existing:
        with exclude.open("a") as file:
            file.write(f"{line}\n")
    return relative.as_posix()


def report(folder: Path) -> str:
    rows = []
    for wheel in sorted(folder.glob("*.whl")):
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()[:12]
        rows.append(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}  sha256 {digest}...")
    total = sum(w.stat().st_size for w in folder.glob("*.whl"))
    return "\n".join(rows + [f"  {total / 2**20:6.2f} MiB in {len(rows)} wheels"])


def verify(folder: Path, *, python_version: str) -> list[str]:
    problems = check(folder, python_version=python_version)
    total = sum(w.stat().st_size for w in folder.glob("*.whl")) if folder.is_dir() else 0
    if total > MAX_FOLDER_BYTES:
        problems.append(f"{folder} holds {total / 2**20:.1f} MiB, over the {MAX_FOLDER_BYTES / 2**20:.0f} MiB meant "
                        "for it (the device tool carries 64 MiB in all)")
    if not problems:
        with tempfile.TemporaryDirectory(prefix="gpu_wheels_target_") as target:
            installed = pip_offline_install(folder, Path(target), python_version=python_version)
            if installed.returncode != 0:
                problems.append(f"pip could not install {folder} offline for CPython {python_version}:\n"
                                f"{installed.stdout}{installed.stderr}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("folder", nargs="?", default=str(DEFAULT_DIR), metavar="DIR",
                        help="where the wheels go (default: .gpu_wheels in the repository root)")
    parser.add_argument("--python-version", default=PYTHON_VERSION, help="the GPU image's Python (default 3.12)")
    parser.add_argument("--check-only", action="store_true", help="check DIR as it is; download nothing")
    args = parser.parse_args(argv)
    folder = Path(args.folder).absolute()
    if args.check_only:
        problems = verify(folder, python_version=args.python_version)
    else:
        if not _replaceable(folder):
            print(f"gpu_wheels: {folder} holds files other than wheels; not replacing it (choose another DIR)",
                  file=sys.stderr)
            return 2
        folder.parent.mkdir(parents=True, exist_ok=True)
        # downloaded and checked beside DIR, then moved in: a failed run leaves DIR as it was
        staging = Path(tempfile.mkdtemp(prefix=".gpu_wheels_download_", dir=folder.parent))
        try:
            fetched = download(staging, python_version=args.python_version)
            if fetched.returncode != 0:
                output = fetched.stdout + fetched.stderr
                unreachable = any(sign in output for sign in UNREACHABLE)
                print(output, file=sys.stderr)
                print(f"gpu_wheels: pip download failed{' (the registry is unreachable)' if unreachable else ''}; "
                      f"{folder} left as it was", file=sys.stderr)
                return 3 if unreachable else 1
            problems = verify(staging, python_version=args.python_version)
            if not problems:
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if problems:
        print(f"gpu_wheels: {folder} is NOT ready:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    excluded = _exclude_from_git(folder)
    print(f"{folder}: ready for CPython {args.python_version} / manylinux x86-64, installs offline\n{report(folder)}")
    if excluded:
        print(f"{excluded} is in .git/info/exclude, so it is never committed; bring it to the GPU machine with the "
              f"repository (a copy of tracked and not-ignored files must be told to carry it, e.g. the device "
              f"tool's run(command='scripts/gpu_check.sh $OUT', carry=['{excluded}']))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
