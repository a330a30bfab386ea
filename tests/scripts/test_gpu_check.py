"""scripts/gpu_check.sh on a machine like the borrowed GPU image, and scripts/gpu_wheels.py's folder for it.

The GPU image lacks albumentations and its closure; scripts/gpu_image/sitecustomize.py hides the development
venv's copies of them (anything installed elsewhere, on PYTHONPATH, still imports), so the dry run here
meets what the real run meets there. The wheel folder for these offline tests is repacked from the venv's
installed distributions (the same files pip would unpack, for this interpreter), so they need no registry;
the one test that downloads the real cp312 folder skips, with one line, when the registry is unreachable.
"""
from __future__ import annotations

import base64
import csv
import glob
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
HIDER = ROOT / "scripts" / "gpu_image"
OUT_FILES = {"summary.txt", "environment.txt", "measurements.txt", "measurements.json", "probes.txt", "train.txt",
             "train_metrics.json", "cuda_tests.txt"}
MEASUREMENTS = ["step", "step_norms", "host_syncs"]
CHECKS = ["fused_grad", "compile_syncbn", "dp_one_gpu", "two_processes_one_gpu"]
TRAININGS = ["train_bf16_channels_last", "train_fp16_resume", "train_off_sigterm"]
# in the script's order: the measurements first, then the correctness steps, the CUDA test files last
FIXED_STEPS = ["environment", "deps", *MEASUREMENTS, *CHECKS, *TRAININGS, "bad_mask", "tf32"]
PROBES = [*MEASUREMENTS, *CHECKS, "train_off_sigterm", "bad_mask", "tf32"]  # scripts.gpu_probes runs
RESERVED_LIMIT = 540  # the bar: the slices add up to at most 9 minutes
DRY_SCALE = 3
LINE = re.compile(r"^(PASS|FAIL|TIMEOUT|SKIPPED) +(\d+)s  (\S+) *(.*)$")
PLAN = re.compile(r"^plan: (.*); reserved (\d+) s of at most (\d+) s, all within (\d+) s")


def _load_gpu_wheels():
    spec = importlib.util.spec_from_file_location("gpu_wheels_under_test", ROOT / "scripts" / "gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_wheels = _load_gpu_wheels()


def cuda_test_files() -> list[str]:
    """What gpu_check.sh runs: the test files that declare the cuda marker (one pytest run each)."""
    marker = "mark." + "cuda"  # spelled apart so this file is not one of them
    return sorted(str(p.relative_to(ROOT / "tests")) for p in (ROOT / "tests").rglob("test_*.py")
                  if marker in p.read_text())


def summary_lines(out: Path) -> dict[str, tuple[str, str]]:
    """{step: (status, detail)} from summary.txt; each step exactly once."""
    steps: dict[str, tuple[str, str]] = {}
    for line in (out / "summary.txt").read_text().splitlines():
        match = LINE.match(line)
        if match:
            status, _, step, detail = match.groups()
            assert step not in steps, f"{step} reported twice:\n{(out / 'summary.txt').read_text()}"
            steps[step] = (status, detail)
    return steps


def plan(out: Path) -> dict[str, int]:
    """{step: reserved seconds} from summary.txt's plan line, in its order; checks the line's own sum."""
    line = next(line for line in (out / "summary.txt").read_text().splitlines() if line.startswith("plan: "))
    match = PLAN.match(line)
    assert match, line
    slices = {name: int(seconds) for name, seconds in (part.rsplit(" ", 2)[:2] for part in match.group(1).split(", "))}
    assert sum(slices.values()) == int(match.group(2)) and int(match.group(3)) == RESERVED_LIMIT, line
    return slices


def check_file_set(out: Path, steps: dict) -> None:
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert set(files) == OUT_FILES, sorted(files)
    assert all(size < 16 * 2**20 for size in files.values()), files
    expected = FIXED_STEPS + [f"cuda_tests:{f}" for f in cuda_test_files()]
    assert list(steps) == expected, (out / "summary.txt").read_text()
    assert list(plan(out)) == [*FIXED_STEPS, "cuda_tests"]
    assert sum(plan(out).values()) <= RESERVED_LIMIT
    assert set(json.loads((out / "train_metrics.json").read_text())) == set(TRAININGS)
    assert "finished with status" in (out / "summary.txt").read_text().splitlines()[-1]


def timeouts(log: Path) -> list[int]:
    """The timeout of every command a log's `=== ... (timeout N s)` header names."""
    return [int(m) for m in re.findall(r"^=== .* \(timeout (\d+) s\)$", log.read_text(), re.M)]


def repack(distribution: importlib.metadata.Distribution, folder: Path) -> Path:
    """A wheel of an installed distribution: its RECORD's files (bytecode and scripts outside the
    package left out), a fresh RECORD, the tags of its WHEEL file."""
    tags = [line.split(":", 1)[1].strip() for line in distribution.read_text("WHEEL").splitlines()
            if line.startswith("Tag:")]
    parts = list(zip(*(tag.split("-") for tag in tags)))
    tag = "-".join(".".join(sorted(set(part))) for part in parts)
    name = re.sub(r"[-_.]+", "_", distribution.metadata["Name"]).lower()
    path = folder / f"{name}-{distribution.version}-{tag}.whl"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    record_name = None
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in distribution.files:
            relative = file.as_posix()
            if relative.startswith("..") or "__pycache__" in relative or relative.endswith(".pyc"):
                continue
            if relative.endswith(".dist-info/RECORD"):
                record_name = relative
                continue
            data = Path(distribution.locate_file(file)).read_bytes()
            archive.writestr(relative, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            writer.writerow([relative, f"sha256={digest}", len(data)])
        writer.writerow([record_name, "", ""])
        archive.writestr(record_name, record.getvalue())
    return path


@pytest.fixture(scope="module")
def venv_wheels(tmp_path_factory) -> Path:
    """The pinned wheel set for THIS interpreter, repacked from the venv (no registry)."""
    folder = tmp_path_factory.mktemp("venv_wheels")
    for name in gpu_wheels.pinned():
        repack(importlib.metadata.distribution(name), folder)
    return folder


def installed_pins() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in gpu_wheels.pinned()}


def run_dry(tmp_path: Path, wheels: Path, *options: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The dry run as the GPU image would see it, started outside the repository with a relative OUT."""
    environment = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(HIDER), "TMPDIR": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--wheels", str(wheels), *options, "out"],
                            cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=540)
    return result, tmp_path / "out"


def test_usage_names_every_step_and_file_and_rejects_bad_arguments(tmp_path):
    usage = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 0
    for name in [*OUT_FILES, *FIXED_STEPS, "cuda_tests", "--dry-run", "--wheels", "--steps", "gpu_wheels.py"]:
        assert name in usage.stdout, name
    for arguments in ([], ["--bogus", "out"], ["a", "b"], ["--wheels"], ["--steps"]):
        result = subprocess.run(["bash", str(SCRIPT), *arguments], capture_output=True, text=True, timeout=30,
                                cwd=tmp_path)
        assert result.returncode == 2, (arguments, result.stderr)
        assert "usage: scripts/gpu_check.sh" in result.stderr
    unknown = subprocess.run(["bash", str(SCRIPT), "--steps", "tf32,tf23", "out"], capture_output=True, text=True,
                             timeout=30, cwd=tmp_path)
    assert unknown.returncode == 2 and "--steps: unknown step 'tf23'; the steps: environment,deps," in unknown.stderr
    assert all(step in unknown.stderr for step in FIXED_STEPS)
    assert list(tmp_path.iterdir()) == []  # nothing created on a usage error


def test_the_hider_hides_the_venv_copies_only(tmp_path):
    """With scripts/gpu_image first on PYTHONPATH albumentations does not import from site-packages,
    and does from another folder on PYTHONPATH (where gpu_check.sh installs it)."""
    code = "import importlib, sys\ntry:\n    importlib.import_module(sys.argv[1])\nexcept ModuleNotFoundError:\n" \
           "    print('hidden')\nelse:\n    print('found')"
    hidden = dict(os.environ, PYTHONPATH=str(HIDER))
    for name in gpu_wheels.hidden_modules():
        assert subprocess.run([sys.executable, "-c", code, name], env=hidden, capture_output=True, text=True,
                              timeout=60).stdout.strip() == "hidden", name
    assert "albumentations" in gpu_wheels.hidden_modules() and "numpy" not in gpu_wheels.hidden_modules()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "albumentations").mkdir(parents=True)
    (elsewhere / "albumentations" / "__init__.py").write_text("")
    moved = dict(os.environ, PYTHONPATH=f"{elsewhere}{os.pathsep}{HIDER}")
    assert subprocess.run([sys.executable, "-c", code, "albumentations"], env=moved, capture_output=True, text=True,
                          timeout=60).stdout.strip() == "found"


def test_wheel_check_accepts_the_closure_and_names_what_is_missing(venv_wheels, tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    pins = installed_pins()
    assert gpu_wheels.check(venv_wheels, python_version=version, pins=pins) == []
    # the hider hides exactly the folder's modules the image does not have
    modules = set()
    for wheel in venv_wheels.glob("*.whl"):
        name = gpu_wheels.normalize(wheel.name.split("-")[0])
        if name not in gpu_wheels.IMAGE_HAS:
            modules |= gpu_wheels.wheel_metadata(wheel)[1]
    assert modules == set(gpu_wheels.hidden_modules())

    broken = tmp_path / "broken"
    shutil.copytree(venv_wheels, broken)
    next(broken.glob("simsimd-*.whl")).unlink()
    problems = "\n".join(gpu_wheels.check(broken, python_version=version, pins=pins))
    assert "simsimd" in problems and "albucore" in problems  # pinned, and albucore's requirement
    wrong_pin = gpu_wheels.check(venv_wheels, python_version=version, pins={**pins, "pydantic": "0.0.1"})
    assert any("pinned pydantic==0.0.1" in problem for problem in wrong_pin)
    compiled = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert any(compiled in problem and "does not install on CPython 3.9" in problem
               for problem in gpu_wheels.check(venv_wheels, python_version="3.9", pins=pins))


@pytest.mark.slow
def test_dry_run_without_wheels_reports_every_step_and_keeps_going(tmp_path):
    """Missing albumentations and no wheels: deps fails with what to do, the measurements and trainings that
    need the data pipeline say so, the torch-only probes and the CUDA tests still run. `--steps` leaves out the
    three torch-only probes that start processes of their own (the full dry run below runs them): they are
    recorded as not selected, and the rest behaves as without it."""
    empty = tmp_path / "no_wheels"
    empty.mkdir()
    left_out = ["two_processes_one_gpu", "dp_one_gpu", "compile_syncbn"]
    chosen = [step for step in FIXED_STEPS if step not in left_out] + ["cuda_tests"]
    result, out = run_dry(tmp_path, empty, "--steps", ",".join(chosen))
    assert result.returncode == 1, result.stdout + result.stderr
    steps = summary_lines(out)
    check_file_set(out, steps)
    status, detail = steps["deps"]
    assert status == "FAIL" and "albumentations" in detail and "gpu_wheels.py" in detail
    assert steps["cuda_tests:model/sync_batchnorm/test_cuda.py"][0] == "SKIPPED"  # ran: the tests skip themselves
    assert "not selected" not in steps["cuda_tests:model/sync_batchnorm/test_cuda.py"][1]
    for step in (*MEASUREMENTS, *TRAININGS, "bad_mask"):
        assert steps[step] == ("SKIPPED", "the runtime requirements do not import (deps)"), step
    # torch and the package's layers only
    for step in ("tf32", "fused_grad"):
        assert steps[step][0] == "SKIPPED" and steps[step][1].startswith("dry run: "), steps[step]
    for step in left_out:
        assert steps[step] == ("SKIPPED", f"not selected (--steps {','.join(chosen)})"), step
    measured = json.loads((out / "measurements.json").read_text())
    assert set(measured) == {"fused_grad", "tf32"}  # the probes that ran
    assert [row["ok"] for row in measured["fused_grad"]["record"]["rows"]] == [True] * 4
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert all(metrics[name]["outcome"] == "not run" for name in TRAININGS)
    assert not list(tmp_path.glob("gpu_check.*"))  # the work folder is gone


@pytest.mark.slow
def test_dry_run_installs_the_wheels_offline_and_runs_every_step(tmp_path, venv_wheels, step_past_its_time):
    """Missing albumentations, wheels at hand: deps installs them into a private folder, and every later
    step (the measurements, pytest collection, train.py) imports them from there; the plan's slices, stretched
    for the CPU, are the commands' timeouts. (The step-budget run of the test after this one runs beside it:
    step_past_its_time.)"""
    result, out = run_dry(tmp_path, venv_wheels)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = summary_lines(out)
    check_file_set(out, steps)
    wheel_count = len(list(venv_wheels.glob("*.whl")))
    assert steps["deps"] == ("PASS", f"installed {wheel_count} wheels from {venv_wheels} into a private folder on "
                                     "PYTHONPATH; the runtime requirements import")
    environment = (out / "environment.txt").read_text()
    assert re.search(r"^albumentations \S+ .*gpu_check\.\w+/site/albumentations/__init__\.py$", environment, re.M)
    assert all(status == "SKIPPED" for step, (status, _) in steps.items() if step not in ("environment", "deps"))
    slices = plan(out)
    for log, names in (("measurements.txt", MEASUREMENTS), ("probes.txt", ["fused_grad", "compile_syncbn", "tf32"])):
        assert max(timeouts(out / log)) <= max(slices[name] for name in names) * DRY_SCALE, log
    for log in ("measurements.txt", "probes.txt", "train.txt"):  # each probe's inner deadline inside its timeout
        for inner, limit in re.findall(r"^=== .*scripts\.gpu_probes --deadline (\d+) .*\(timeout (\d+) s\)$",
                                       (out / log).read_text(), re.M):
            assert int(inner) <= int(limit) - 5, (log, inner, limit)
    assert "img/s" in steps["step"][1] and "MFU not computed: no bf16 peak known for cpu" in steps["step"][1]
    assert "ours / bn" in steps["step_norms"][1] and "A/A" in steps["step_norms"][1]
    assert "{'one process': 0, 'synchronized': 0}" in steps["host_syncs"][1]
    measured = json.loads((out / "measurements.json").read_text())
    assert set(measured) == set(PROBES)
    assert all(entry["outcome"] in ("done", "cannot run here") for entry in measured.values()), measured
    step = measured["step"]["record"]
    assert step["flops_per_step"] > 1e9 and step["images_per_s"] > 0 and step["windows"] >= 1
    norms = measured["step_norms"]["record"]
    assert norms["rounds"] >= 1 and set(norms["step_ms"]) == {"ours", "bn", "bn_copy"}
    assert measured["host_syncs"]["record"]["syncs"] == {"one process": 0, "synchronized": 0}
    assert [row["ok"] for row in measured["fused_grad"]["record"]["rows"]] == [True] * 4
    assert "its last.pt made unfused, resumed to 2" in steps["train_fp16_resume"][1]
    assert "exit 143" in steps["train_off_sigterm"][1] and "stopped at iteration" in steps["train_off_sigterm"][1]
    assert "exit 2 and one line: ...mask value 9 is not a class index" in steps["bad_mask"][1]
    assert "the survivor's line is the lost-contact line" in steps["two_processes_one_gpu"][1]
    assert "1 graph(s), 0 break(s), compiled with aot_eager" in steps["compile_syncbn"][1]
    assert steps["dp_one_gpu"] == ("SKIPPED", "needs CUDA: DataParallel replicates only onto GPUs")
    metrics = json.loads((out / "train_metrics.json").read_text())
    resumed = metrics["train_fp16_resume"]
    assert resumed["outcome"] == "done" and resumed["dry_run"] is True
    assert [(r["type"], r["iteration"]) for r in resumed["metrics"]] == [("train", 1), ("val", 1), ("train", 2), ("val", 2)]
    assert "last.pt" in resumed["run_files"]  # listed, not copied
    assert metrics["train_off_sigterm"]["outcome"] == "done" and "last.pt" in metrics["train_off_sigterm"]["run_files"]
    assert not list(tmp_path.glob("gpu_check.*"))


BUDGET = 75  # the step-budget run's GPU_CHECK_SECONDS (step_past_its_time)


@pytest.fixture(scope="module")
def step_past_its_time(tmp_path_factory):
    """gpu_check.sh with GPU_CHECK_SECONDS=BUDGET and a first measurement that hangs (a PYTHON wrapper sleeps
    instead of `scripts.gpu_probes ... step`), started when first requested and left to run: it waits, it does not compute, so
    the full dry run, which requests it, runs beside it instead of this file's worker idling for BUDGET s.
    Yields a function that waits for it and returns (exit status, seconds it ran, its OUT folder, console).

    The budget must leave what runs before the training (the environment and deps steps and the deps
    listing: real imports, 7 s on an idle machine) the 10 s a step needs: on a loaded CI machine they took
    36 s (with pytest-xdist's other worker running 16 gloo processes), and a budget of 45 s (20 s before that)
    skipped the step instead of timing it out."""
    folder = tmp_path_factory.mktemp("past_its_time")
    wrapper = folder / "python"
    wrapper.write_text(f"""#!/bin/bash
case " $* " in
  *" scripts.gpu_probes "*" step "*) exec sleep 300 ;;
esac
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    environment = {**os.environ, "PYTHON": str(wrapper), "GPU_CHECK_SECONDS": str(BUDGET), "TMPDIR": str(folder)}
    console = folder / "console.txt"
    with console.open("w") as file:
        process = subprocess.Popen(["bash", str(SCRIPT), "--dry-run", str(folder / "out")], env=environment,
                                   stdout=file, stderr=subprocess.STDOUT)
    started = time.monotonic()
    ended: list[float] = []
    watcher = threading.Thread(target=lambda: (process.wait(), ended.append(time.monotonic())), daemon=True)
    watcher.start()

    def finish() -> tuple[int, float, Path, str]:
        watcher.join(timeout=300)
        assert ended, f"gpu_check.sh still running 300 s after its {BUDGET} s budget"
        return process.returncode, ended[0] - started, folder / "out", console.read_text()

    try:
        yield finish
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_a_step_past_its_time_is_stopped_and_the_rest_reported(step_past_its_time):
    """The first measurement is stopped at the deadline (TIMEOUT), the steps after it are recorded as not run,
    every file is there, and the whole run ends within the budget plus timeout's kill grace."""
    returncode, elapsed, out, console = step_past_its_time()
    steps = summary_lines(out)
    check_file_set(out, steps)
    assert returncode == 1, console
    first = steps["step"]
    assert first[0] == "TIMEOUT" and first[1].startswith("stopped after"), console
    later = FIXED_STEPS[FIXED_STEPS.index("step") + 1:] + [f"cuda_tests:{f}" for f in cuda_test_files()]
    for step in later:
        assert steps[step] == ("SKIPPED", f"not run: no time left of the {BUDGET} s for all steps"), (step, console)
    measured = json.loads((out / "measurements.json").read_text())
    assert measured["step"]["outcome"] == "timed out" and measured["step"]["record"] is None
    assert measured["tf32"]["outcome"] == "not run: no time left"
    assert json.loads((out / "train_metrics.json").read_text())["train_fp16_resume"]["outcome"] == "not run: no time left"
    assert elapsed < BUDGET + 5 + 15, elapsed  # budget, timeout's kill grace, the bookkeeping
    assert not list(out.parent.glob("gpu_check.*"))


def test_a_plan_over_nine_minutes_is_refused(tmp_path):
    """The slices must add up to at most RESERVED_LIMIT: a plan that does not is a usage error, before anything
    runs or is created."""
    script = (tmp_path / "scripts")
    script.mkdir()
    text = SCRIPT.read_text()
    block = text[text.index('PLAN="'):text.index('"', text.index('PLAN="') + 6)]
    reserved = sum(int(line.split()[1]) for line in block[6:].splitlines())
    assert reserved <= RESERVED_LIMIT
    seconds = int(re.search(r"^step (\d+)$", block, re.M).group(1))
    (script / "gpu_check.sh").write_text(re.sub(r"^step \d+$", "step 600", text, count=1, flags=re.M))
    result = subprocess.run(["bash", str(script / "gpu_check.sh"), "--dry-run", "out"], capture_output=True, text=True,
                            timeout=30, cwd=tmp_path)
    expected = f"its PLAN reserves {reserved - seconds + 600} s, more than {RESERVED_LIMIT} s"
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def downloaded_wheels(tmp_path_factory) -> Path:
    """scripts/gpu_wheels.py's real folder for the GPU image (CPython 3.12), downloaded once a module."""
    folder = tmp_path_factory.mktemp("gpu_wheels") / "wheels"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_wheels.py"), str(folder)],
                            capture_output=True, text=True, timeout=900)
    if result.returncode == 3:
        pytest.skip(f"the package registry is unreachable: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stdout + result.stderr
    return folder


@pytest.mark.slow
def test_gpu_wheels_folder_installs_offline_into_a_clean_312_target(downloaded_wheels, tmp_path):
    files = sorted(downloaded_wheels.iterdir())
    assert {gpu_wheels.normalize(p.name.split("-")[0]) for p in files} == set(gpu_wheels.pinned())
    assert sum(p.stat().st_size for p in files) < 16 * 2**20
    assert gpu_wheels.check(downloaded_wheels, python_version="3.12") == []
    target = tmp_path / "target"
    installed = gpu_wheels.pip_offline_install(downloaded_wheels, target, python_version="3.12")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    for module in gpu_wheels.hidden_modules():
        assert list(target.glob(f"{module}*")), module
    assert list(target.glob("pydantic_core/_pydantic_core.cpython-312-x86_64-linux-gnu.so"))
    # a folder with a wheel missing is refused before anything is installed
    broken = tmp_path / "broken"
    shutil.copytree(downloaded_wheels, broken)
    next(broken.glob("pydantic_core-*.whl")).unlink()
    assert subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_wheels.py"), "--check-only", str(broken)],
                          capture_output=True, text=True, timeout=300).returncode == 1


def _python_312() -> str | None:
    candidates = [shutil.which("python3.12"),
                  *glob.glob(os.path.join(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")),
                                          "versions", "3.12*", "bin", "python3.12"))]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                               capture_output=True, text=True, timeout=60)
        if probe.stdout.strip() == "True":
            return candidate
    return None


@pytest.mark.slow
def test_gpu_wheels_compiled_parts_import_on_python_312(downloaded_wheels, tmp_path):
    """The cp312 wheels that need no numpy (pydantic and its core, stringzilla, simsimd) install with a
    real CPython 3.12's own pip, offline, and import there."""
    python = _python_312()
    if python is None:
        pytest.skip("no CPython 3.12 on this machine")
    target = tmp_path / "site"
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                              str(target), *map(str, downloaded_wheels.glob("*.whl"))],
                             capture_output=True, text=True, timeout=300, env=dict(os.environ, PIP_ROOT_USER_ACTION="ignore"))
    assert install.returncode == 0, install.stderr
    code = "import pydantic, pydantic_core, stringzilla, simsimd, typing_inspection; print(pydantic.VERSION)"
    imported = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(target)))
    assert imported.stdout.strip() == gpu_wheels.pinned()["pydantic"], imported.stderr


@pytest.mark.slow
def test_a_long_log_is_capped_and_its_result_kept(tmp_path):
    """A probe that prints megabytes: its log keeps the head and the tail (RESULT and RECORD lines included)
    with the cut marked, so that the file comes back whatever a step prints."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/bash
case " $* " in
  *" scripts.gpu_probes "*" tf32 "*)
    yes "a line of a probe that talks too much" | head -n 200000
    echo 'RECORD: {{"lines": 200000}}'
    echo "RESULT: said everything"
    exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    environment = {**os.environ, "PYTHON": str(wrapper), "LOG_CAP_KIB": "8", "TMPDIR": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--steps", "tf32", str(tmp_path / "out")],
                            env=environment, capture_output=True, text=True, timeout=300)
    out = tmp_path / "out"
    log = (out / "probes.txt").read_text()
    assert len(log) < 10 * 1024 and "bytes cut here" in log, len(log)
    assert log.index("a line of a probe") < log.index("bytes cut here") < log.index("RESULT: said everything")
    assert summary_lines(out)["tf32"] == ("SKIPPED", "dry run: no CUDA device; measured on the CPU (said everything)"), \
        result.stdout + result.stderr
    assert json.loads((out / "measurements.json").read_text())["tf32"]["record"] == {"lines": 200000}


def test_a_probe_past_its_inner_deadline_says_so_and_stops_its_children(tmp_path):
    """--deadline: the probe's own limit. A two-process probe given 4 s prints the RESULT line that says it was
    stopped, kills the ranks it started and exits 1, long before the ranks would have finished."""
    marker = tmp_path / "ranks"
    code = ("import sys, time, multiprocessing as mp\n"
            "from scripts import gpu_probes\n"
            "gpu_probes._start_deadline(4, 'sleepy')\n"
            f"ranks = [mp.get_context('spawn').Process(target=time.sleep, args=(120,)) for _ in range(2)]\n"
            "[rank.start() for rank in ranks]\n"
            f"open({str(marker)!r}, 'w').write(' '.join(str(rank.pid) for rank in ranks))\n"
            "time.sleep(120)\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1 and time.monotonic() - started < 30, result.stdout + result.stderr
    assert "RESULT: sleepy stopped by its inner deadline of 4 s" in result.stdout
    time.sleep(0.5)
    for pid in map(int, marker.read_text().split()):
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), pid
