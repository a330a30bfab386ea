"""The Makefile's venv, installed from requirements-lock.txt in parallel pip processes.

    python scripts/requirements_lock.py write                 # re-resolve requirements-test.txt into the lock
    VENV/bin/python scripts/requirements_lock.py install      # what `make venv` runs, with the venv's python

`pip install -r requirements-test.txt` spends most of `make venv` in one process: resolving the closure (about
25 s, most of it asking the package indexes about each of ~100 distributions), then unpacking ~6 GB (torch's
CUDA build and its nvidia-* libraries) and byte-compiling them, one wheel after the other, on one core.
requirements-lock.txt is that closure written down once (every distribution at its version, with the size
of its wheel where it lay on this machine's disk); `install` splits it into parts of about equal size and
runs one `pip install --no-deps` per part at the same time, then `pip check`. On the 2-core dev VM: 68 s
instead of 103 s.

`install` falls back to the resolving `pip install -r requirements-test.txt` (and says why) when the lock does
not apply: another Python version or platform than the lock's, a pin of requirements*.txt that the lock has
at another version or not at all (the lock is stale: run `write`), or a parallel install that failed.
Standard library only: it runs before anything is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements-lock.txt"
REQUIREMENTS = ROOT / "requirements-test.txt"
PARTS = 2  # the CI machine's cores
OVERHEAD_MB = 10.0  # what a distribution costs beyond its bytes (index lookup, metadata, RECORD), in MB of wheel
UNKNOWN_MB = 5.0  # the size assumed for a wheel that did not lie on this machine's disk
PIP = ["-m", "pip", "--disable-pip-version-check"]

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*(?:#\s*([0-9.]+)\s*MB)?\s*$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def environment() -> str:
    """What a lock is valid for: the interpreter's minor version and the platform (wheels' tags differ)."""
    return f"python {sys.version_info.major}.{sys.version_info.minor} {sys.platform} {platform.machine()}"


def read_lock(path: Path) -> tuple[str, dict[str, tuple[str, str, float | None]]]:
    """(the environment it was written for, {canonical name: (name, version, wheel MB or None)})."""
    target, pins = "", {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line.startswith("# environment:"):
            target = line.split(":", 1)[1].strip()
            continue
        if not line or line.startswith("#"):
            continue
        match = _PIN.match(line)
        if match is None:
            raise ValueError(f"{path}:{number}: expected 'name==version' (optionally '# N MB'), got {raw!r}")
        name, version, size = match.groups()
        pins[canonical(name)] = (name, version, float(size) if size else None)
    if not target:
        raise ValueError(f"{path}: no '# environment: ...' line (write it with: python {Path(__file__).name} write)")
    return target, pins


def requirement_pins(path: Path, seen: set[Path] | None = None) -> dict[str, tuple[str, str, str]]:
    """{canonical name: (name, version, where)} of every `name==version` line of a requirements file and the
    files it includes with -r. A requirement that is not an exact pin has version ''."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:
        return {}
    seen.add(path)
    pins = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith(("-r ", "--requirement ")):
            pins.update(requirement_pins(path.parent / line.split(None, 1)[1], seen))
            continue
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(==\s*([^\s;]+))?", line)
        if match:
            pins[canonical(match.group(1))] = (match.group(1), match.group(3) or "", f"{path.name}:{number}")
    return pins


def stale(lock: dict[str, tuple[str, str, float | None]], requirements: dict[str, tuple[str, str, str]]) -> list[str]:
    """What the lock gets wrong about the requirements, one line each (empty: it applies)."""
    problems = []
    for key, (name, version, where) in sorted(requirements.items()):
        if key not in lock:
            problems.append(f"{name} ({where}) is not in the lock")
        elif version and lock[key][1] != version:
            problems.append(f"{name}=={version} ({where}) is {lock[key][1]} in the lock")
    return problems


def partition(lock: dict[str, tuple[str, str, float | None]], parts: int) -> list[list[str]]:
    """The lock's pins in `parts` groups of about equal work: largest first, each to the lightest group."""
    weighted = sorted(((size if size is not None else UNKNOWN_MB) + OVERHEAD_MB, f"{name}=={version}")
                      for name, version, size in lock.values())
    groups: list[list[str]] = [[] for _ in range(max(1, parts))]
    loads = [0.0] * len(groups)
    for weight, pin in reversed(weighted):
        lightest = loads.index(min(loads))
        groups[lightest].append(pin)
        loads[lightest] += weight
    return [group for group in groups if group]


def resolving_install(python: str, reason: str) -> int:
    print(f"requirements_lock: {reason}; installing {REQUIREMENTS.name} with pip's resolver instead", flush=True)
    return subprocess.call([python, *PIP, "install", "--quiet", "-r", str(REQUIREMENTS)])


def install(python: str, parts: int) -> int:
    """Install the lock into `python`'s environment in `parts` concurrent pip processes; the resolving install
    where the lock does not apply or the parallel one fails. Then `pip check`. Returns an exit status."""
    try:
        target, lock = read_lock(LOCK)
    except (OSError, ValueError) as error:
        status = resolving_install(python, f"cannot use the lock: {error}")
    else:
        problems = stale(lock, requirement_pins(REQUIREMENTS))
        if target != environment():
            status = resolving_install(python, f"{LOCK.name} is for {target}, this is {environment()}")
        elif problems:
            status = resolving_install(python, f"{LOCK.name} is stale ({'; '.join(problems)}); rewrite it with "
                                               f"`python scripts/requirements_lock.py write`")
        else:
            status = parallel_install(python, partition(lock, parts))
            if status != 0:
                status = resolving_install(python, f"the parallel install of {LOCK.name} failed (exit {status})")
    if status != 0:
        return status
    check = subprocess.run([python, *PIP, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        print(f"requirements_lock: `pip check` after the install:\n{check.stdout}{check.stderr}", file=sys.stderr)
    return check.returncode


def parallel_install(python: str, groups: list[list[str]]) -> int:
    with tempfile.TemporaryDirectory() as folder:
        processes = []
        for index, group in enumerate(groups):
            listing = Path(folder) / f"part{index}.txt"
            listing.write_text("\n".join(group) + "\n")
            log = (Path(folder) / f"part{index}.log").open("w+")
            command = [python, *PIP, "install", "--quiet", "--no-deps", "-r", str(listing)]
            processes.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log, group))
        status = 0
        for process, log, group in processes:
            code = process.wait()
            if code != 0:
                log.seek(0)
                tail = "".join(line for line in log.readlines() if not line.startswith("WARNING: Location"))[-3000:]
                print(f"requirements_lock: pip failed (exit {code}) on {len(group)} pins ({', '.join(group[:4])}"
                      f"{', ...' if len(group) > 4 else ''}):\n{tail}", file=sys.stderr)
                status = status or code
            log.close()
    return status


def write(python: str) -> int:
    """Resolve requirements-test.txt for this interpreter (nothing installed) and write the lock."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        result = subprocess.run([python, *PIP, "install", "--quiet", "--dry-run", "--ignore-installed",
                                 "--report", str(report), "-r", str(REQUIREMENTS)])
        if result.returncode != 0:
            return result.returncode
        installs = json.loads(report.read_text())["install"]
    lines = [
        "# Every distribution `pip install -r requirements-test.txt` installs, at its version: what `make venv`",
        "# installs in parallel pip processes (scripts/requirements_lock.py, which says how it falls back).",
        "# Written by `python scripts/requirements_lock.py write`; rewrite it after changing requirements*.txt",
        "# (tests/scripts/test_requirements_lock.py fails until then). Sizes: the wheel where it lay on disk.",
        f"# environment: {environment()}",
    ]
    for item in sorted(installs, key=lambda item: canonical(item["metadata"]["name"])):
        url = item["download_info"]["url"]
        size = ""
        if url.startswith("file://") and os.path.exists(url[len("file://"):]):
            size = f"  # {os.path.getsize(url[len('file://'):]) / 1e6:.1f} MB"
        lines.append(f"{item['metadata']['name']}=={item['metadata']['version']}{size}")
    LOCK.write_text("\n".join(lines) + "\n")
    print(f"wrote {LOCK} ({len(installs)} distributions, {environment()})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["install", "write"])
    parser.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
    parser.add_argument("--parts", type=int, default=PARTS, help=f"concurrent pip processes (default {PARTS})")
    args = parser.parse_args(argv)
    return install(args.python, args.parts) if args.command == "install" else write(args.python)


if __name__ == "__main__":
    sys.exit(main())
