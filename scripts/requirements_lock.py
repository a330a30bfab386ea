"""The Makefile's venv, installed from requirements-lock.txt: by uv where it can be had, else in parallel pips.

    python scripts/requirements_lock.py write                 # re-resolve requirements-test.txt into the lock
    VENV/bin/python scripts/requirements_lock.py install      # what `make venv` runs, with the venv's python

`pip install -r requirements-test.txt` spends most of `make venv` in one process: resolving the closure (about
25 s, most of it asking the package indexes about each of ~100 distributions), then unpacking ~6 GB (torch's
CUDA build and its nvidia-* libraries) and byte-compiling them, one wheel after the other, on one core.
requirements-lock.txt is that closure written down once (every distribution at its version, with the size
of its wheel where it lay on this machine's disk). `install` hands the lock to uv (`uv pip install --no-deps`,
pinned below, installed by pip into VENV/uv: one 17 MB wheel): it unpacks on every core and keeps the unpacked
wheels in its cache (~/.cache/uv, or UV_CACHE_DIR), from which a later venv is hard links. It does not
byte-compile (pip would): Python compiles each module when it is first imported and keeps the result (the
Makefile lets it write bytecode caches), the ~2,800 files that collecting the tests imports and a few more,
where byte-compiling every file of the venv made the install take 34 s and 59 busy core-seconds instead of
5 s and 6 on the 2-core dev VM with uv's cache filled (collecting the tests then takes 14 more core-seconds,
once). It reads no uv configuration (--no-config); its package sources are pip's (`pip config list`:
index-url, extra-index-url, find-links, no-index, cert). The lock in two pip processes took 68-80 s, the
resolving pip 103 s.

Where uv cannot be installed or fails, the lock goes to PARTS concurrent `pip install --no-deps` processes
(parts of about equal size); where the lock does not apply (another Python version or platform than the
lock's, a pin of requirements*.txt that the lock has at another version or not at all: run `write`) or the
parallel install fails too, to the resolving `pip install -r requirements-test.txt`. Each step says why it
was left. Then `pip check`. Standard library only: it runs before anything is installed.
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
UV = "uv==0.13.9"  # the installer, from PyPI (a wheel holding one static binary)
UV_FOLDER = "uv"  # where in the venv pip puts it (outside site-packages: nothing of it imports)

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
    """Install the lock into `python`'s environment: with uv, else in `parts` concurrent pip processes, else
    with pip's resolver (where the lock does not apply, or both fail). Then `pip check`. Returns an exit status."""
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
            pins = [f"{name}=={version}" for name, version, _ in lock.values()]
            status = uv_install(python, pins)
            if status != 0:
                print(f"requirements_lock: installing {LOCK.name} in {parts} pip processes instead", flush=True)
                status = parallel_install(python, partition(lock, parts))
            if status != 0:
                status = resolving_install(python, f"the parallel install of {LOCK.name} failed (exit {status})")
    if status != 0:
        return status
    check = subprocess.run([python, *PIP, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        print(f"requirements_lock: `pip check` after the install:\n{check.stdout}{check.stderr}", file=sys.stderr)
    return check.returncode


def _without_location_warnings(output: str) -> str:
    """pip's output less its "WARNING: Location ... is ignored" lines (one per configured index folder that
    lacks a package: noise beside the error that matters)."""
    return "".join(line + "\n" for line in output.splitlines() if not line.startswith("WARNING: Location"))


def pip_sources(python: str) -> tuple[list[str], dict[str, str]]:
    """pip's package sources for `python` (its configuration files and PIP_* variables, as `pip config list`
    shows them) as uv options, and the environment uv needs for pip's certificate bundle."""
    listing = subprocess.run([python, *PIP, "config", "list"], capture_output=True, text=True)
    rank = {"global": 0, "user": 1, "site": 2, ":env:": 3}  # pip's precedence, lowest first
    values: dict[str, tuple[int, str]] = {}
    for line in listing.stdout.splitlines():
        match = re.match(r"^([^.=]+|:env:)\.([a-z-]+)=(.*)$", line.strip())
        if match is None:
            continue
        scope, key, value = match.groups()
        value = value.strip().strip("'\"")
        level = rank.get(scope, 0)
        if key not in values or level >= values[key][0]:
            values[key] = (level, value)
    options: list[str] = []
    if values.get("no-index", (0, ""))[1].lower() in ("1", "true", "yes", "on"):
        options.append("--no-index")
    if "index-url" in values:
        options += ["--index-url", values["index-url"][1]]
    for key, flag in (("extra-index-url", "--extra-index-url"), ("find-links", "--find-links")):
        for value in values.get(key, (0, ""))[1].split():
            options += [flag, value]
    environment = {}
    if "cert" in values and "SSL_CERT_FILE" not in os.environ:
        environment["SSL_CERT_FILE"] = values["cert"][1]
    return options, environment


def uv_install(python: str, pins: list[str]) -> int:
    """The pins into `python`'s venv with uv (no resolution: --no-deps; the version pip would take from any
    of its sources: --index-strategy unsafe-best-match; not byte-compiled: see the module's docstring). 0, or why
    not (printed)."""
    folder = Path(python).absolute().parent.parent / UV_FOLDER
    uv = folder / "bin" / "uv"
    if not uv.is_file():
        got = subprocess.run([python, *PIP, "install", "--quiet", "--no-deps", "--target", str(folder), UV],
                             capture_output=True, text=True)
        if got.returncode != 0 or not uv.is_file():
            output = _without_location_warnings(got.stdout + got.stderr)
            print(f"requirements_lock: could not install {UV} (pip exit {got.returncode}):\n{output[-2000:]}",
                  file=sys.stderr, flush=True)
            return got.returncode or 1
    sources, environment = pip_sources(python)
    with tempfile.TemporaryDirectory() as temporary:
        listing = Path(temporary) / "pins.txt"
        listing.write_text("\n".join(pins) + "\n")
        command = [str(uv), "pip", "install", "--quiet", "--no-config", "--python", python, "--no-deps",
                   "--index-strategy", "unsafe-best-match", *sources, "-r", str(listing)]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **environment})
    if done.returncode != 0:
        print(f"requirements_lock: uv failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}",
              file=sys.stderr, flush=True)
    return done.returncode


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
                tail = _without_location_warnings(log.read())[-3000:]
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
