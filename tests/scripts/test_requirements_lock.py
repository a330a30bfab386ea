"""requirements-lock.txt and scripts/requirements_lock.py, which `make venv` installs it with: the lock is the
closure this venv holds, it goes stale visibly, uv gets it with pip's package sources, without uv its parts
(disjoint and balanced) install in pips at the same time, and every case where the lock does not apply falls
back to pip's resolver, saying why."""
from __future__ import annotations

import importlib.metadata
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from scripts import requirements_lock as lock_module


def _installed() -> dict[str, str]:
    """The distributions installed in this venv's site-packages: not the whole sys.path, where setuptools,
    once imported, appends its _vendor folder (which holds another packaging's dist-info)."""
    folders = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {lock_module.canonical(d.metadata["Name"]): d.version
            for d in importlib.metadata.distributions(path=folders)}


def test_the_committed_lock_pins_every_requirement_and_is_what_this_venv_holds():
    target, lock = lock_module.read_lock(lock_module.LOCK)
    if target != lock_module.environment():
        pytest.skip(f"the lock is for {target}; this is {lock_module.environment()} (make venv resolves here)")
    requirements = lock_module.requirement_pins(lock_module.REQUIREMENTS)
    assert {"torch", "pytest", "albumentations", "onnx"} <= set(requirements)  # -r requirements.txt followed
    assert lock_module.stale(lock, requirements) == []
    installed = _installed()
    wrong = {key: (version, installed.get(key)) for key, (_, version, _) in lock.items() if installed.get(key) != version}
    assert wrong == {}, f"the venv differs from requirements-lock.txt (lock, venv): {wrong}"
    # the closure: nothing beyond the lock but pip and the project itself
    assert set(installed) - set(lock) <= {"pip", "syncseg"}, sorted(set(installed) - set(lock))


def test_a_changed_or_missing_pin_makes_the_lock_stale(tmp_path):
    (tmp_path / "base.txt").write_text("# runtime\ntorch==2.14.1  # pinned\nnumpy==2.4.6\nPyYAML==6.0.4\n")
    (tmp_path / "test.txt").write_text("-r base.txt\npytest==9.2.0\nsome_new-package>=1\n")
    requirements = lock_module.requirement_pins(tmp_path / "test.txt")
    assert requirements["pyyaml"] == ("PyYAML", "6.0.4", "base.txt:4")
    assert requirements["some-new-package"][1] == ""
    lock = {"torch": ("torch", "2.14.1", 554.6), "numpy": ("numpy", "2.4.5", 16.9), "pyyaml": ("PyYAML", "6.0.4", None),
            "pytest": ("pytest", "9.2.0", None)}
    assert lock_module.stale(lock, requirements) == ["numpy==2.4.6 (base.txt:3) is 2.4.5 in the lock",
                                                     "some_new-package (test.txt:3) is not in the lock"]
    lock["numpy"] = ("numpy", "2.4.6", 16.9)
    lock["some-new-package"] = ("some-new-package", "1.2", None)
    assert lock_module.stale(lock, requirements) == []


def test_the_lock_file_reads_back_and_a_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text("# header\n# environment: python 3.11 linux x86_64\nTorch==2.14.1  # 554.6 MB\npy_yaml==6.0\n")
    assert lock_module.read_lock(path) == ("python 3.11 linux x86_64",
                                           {"torch": ("Torch", "2.14.1", 554.6), "py-yaml": ("py_yaml", "6.0", None)})
    path.write_text("# environment: python 3.11 linux x86_64\ntorch>=2\n")
    with pytest.raises(ValueError, match=r"lock.txt:2: expected 'name==version'.*'torch>=2'"):
        lock_module.read_lock(path)
    path.write_text("torch==2.14.1\n")
    with pytest.raises(ValueError, match="no '# environment: ...' line"):
        lock_module.read_lock(path)


def test_the_parts_are_disjoint_cover_the_lock_and_are_balanced():
    _, lock = lock_module.read_lock(lock_module.LOCK)
    for parts in (1, 2, 3):
        groups = lock_module.partition(lock, parts)
        pins = [pin for group in groups for pin in group]
        assert sorted(pins) == sorted(f"{name}=={version}" for name, version, _ in lock.values())
        assert len(groups) == parts
        weight = {f"{name}=={version}": (size if size is not None else lock_module.UNKNOWN_MB) + lock_module.OVERHEAD_MB
                  for name, version, size in lock.values()}
        loads = [sum(weight[pin] for pin in group) for group in groups]
        assert max(loads) - min(loads) <= max(weight.values()), loads  # greedy, largest first
    # the two largest wheels (torch's CUDA build and cuDNN) go to different parts
    first, second = lock_module.partition(lock, 2)
    assert any(pin.startswith("torch==") for pin in first) != any(pin.startswith("nvidia-cudnn-") for pin in first)


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for the venv's python: `-m pip install ... -r PART` runs `body` (bash)."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/bash\nlog={tmp_path}/calls\necho \"$@\" >> $log\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_the_parts_install_at_the_same_time_with_no_deps(tmp_path):
    """Each fake pip writes its start mark, then waits (at most 20 s) for the other's: both finish only if
    they ran together."""
    body = """part=${@: -1}; touch "$part.started"
for i in $(seq 200); do [ $(ls $(dirname $part)/*.started | wc -l) -ge 2 ] && exit 0; sleep 0.1; done; exit 7"""
    python = _fake_python(tmp_path, body)
    started = time.monotonic()
    assert lock_module.parallel_install(python, [["torch==2.14.1"], ["numpy==2.4.6", "pytest==9.2.0"]]) == 0
    assert time.monotonic() - started < 15
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and all("install --quiet --no-deps -r" in call for call in calls), calls


def test_a_failed_part_reports_its_output(tmp_path, capsys):
    python = _fake_python(tmp_path, 'echo "WARNING: Location x is ignored"; echo "ERROR: no space left"; exit 3')
    assert lock_module.parallel_install(python, [["torch==2.14.1"]]) == 3
    err = capsys.readouterr().err
    assert "pip failed (exit 3) on 1 pins (torch==2.14.1)" in err and "ERROR: no space left" in err
    assert "WARNING: Location" not in err


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """install() with its pip calls recorded: the resolving install's reason, the parallel install's parts,
    and `pip check` answered by a fake."""
    calls: dict[str, list] = {"resolving": [], "uv": [], "parallel": [], "check": []}
    monkeypatch.setattr(lock_module, "resolving_install", lambda python, reason: calls["resolving"].append(reason) or 0)
    monkeypatch.setattr(lock_module, "uv_install",
                        lambda python, pins: calls["uv"].append(pins) or calls.get("uv_status", 0))
    monkeypatch.setattr(lock_module, "parallel_install",
                        lambda python, groups: calls["parallel"].append(groups) or calls.get("parallel_status", 0))

    class Checked:
        returncode, stdout, stderr = 0, "No broken requirements found.\n", ""

    monkeypatch.setattr(lock_module.subprocess, "run", lambda command, **kw: calls["check"].append(command) or Checked)
    requirements = tmp_path / "requirements-test.txt"
    requirements.write_text("torch==2.14.1\n")
    monkeypatch.setattr(lock_module, "REQUIREMENTS", requirements)
    monkeypatch.setattr(lock_module, "LOCK", tmp_path / "requirements-lock.txt")
    return calls


def _write_lock(path: Path, environment: str, torch_version: str = "2.14.1") -> None:
    path.write_text(f"# environment: {environment}\ntorch=={torch_version}  # 554.6 MB\nnumpy==2.4.6\n")


def test_install_gives_the_lock_to_uv_where_it_applies(recorded):
    _write_lock(lock_module.LOCK, lock_module.environment())
    assert lock_module.install("py", 2) == 0
    assert recorded["uv"] == [["torch==2.14.1", "numpy==2.4.6"]]
    assert recorded["resolving"] == [] and recorded["parallel"] == []
    assert recorded["check"] == [["py", "-m", "pip", "--disable-pip-version-check", "check"]]


def test_without_uv_the_lock_goes_to_parallel_pips_and_says_so(recorded, capsys):
    _write_lock(lock_module.LOCK, lock_module.environment())
    recorded["uv_status"] = 1
    assert lock_module.install("py", 2) == 0
    assert recorded["parallel"] == [[["torch==2.14.1"], ["numpy==2.4.6"]]] and recorded["resolving"] == []
    assert "installing requirements-lock.txt in 2 pip processes instead" in capsys.readouterr().out
    assert len(recorded["check"]) == 1


def test_pips_sources_become_uvs_options(tmp_path):
    """Every source pip is configured with (files and PIP_* variables, the variables winning), and nothing
    else: uv reads no configuration of its own."""
    listing = tmp_path / "listing.txt"
    listing.write_text("global.index-url='https://mirror.example/simple'\n"
                       "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'\n"
                       "global.find-links='/opt/wheels'\n"
                       "global.constraint='/etc/xdg/pip/constraints.txt'\n"
                       "global.cert='/etc/ssl/custom.pem'\n"
                       ":env:.find-links='/srv/wheels'\n"
                       "user.no-index='false'\n")
    python = _fake_python(tmp_path, f"cat {listing}")
    options, environment = lock_module.pip_sources(python)
    assert options == ["--index-url", "https://mirror.example/simple", "--extra-index-url", "file:///opt/pypi/simple",
                       "--extra-index-url", "file:///opt/pypi-more/simple", "--find-links", "/srv/wheels"]
    assert "config list" in (tmp_path / "calls").read_text()
    expected = {} if "SSL_CERT_FILE" in lock_module.os.environ else {"SSL_CERT_FILE": "/etc/ssl/custom.pem"}
    assert environment == expected
    listing.write_text("global.no-index='true'\n")
    assert lock_module.pip_sources(python)[0] == ["--no-index"]


def _fake_venv_python(tmp_path: Path, body: str) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    Path(_fake_python(tmp_path, body)).rename(python)
    return python


def test_uv_is_installed_into_the_venv_and_installs_the_pins_without_resolving(tmp_path):
    # the fake venv python's `pip install --target F uv==...` puts into F/bin a fake uv that records its call
    fake_uv = tmp_path / "fake_uv"
    fake_uv.write_text(f"""#!/bin/bash
echo "$@" > {tmp_path}/uv_call
for argument in "$@"; do [ -f "$argument" ] && cp "$argument" {tmp_path}/uv_pins; done
exit 0
""")
    body = f"""case "$*" in
  *"config list"*) echo "global.find-links='/opt/wheels'" ;;
  *"--target"*) target=$(echo "$*" | sed 's/.*--target \\([^ ]*\\).*/\\1/'); mkdir -p $target/bin
                cp {fake_uv} $target/bin/uv; chmod +x $target/bin/uv ;;
esac"""
    python = _fake_venv_python(tmp_path, body)
    assert lock_module.uv_install(str(python), ["torch==2.14.1", "numpy==2.4.6"]) == 0
    assert (python.parent.parent / lock_module.UV_FOLDER / "bin" / "uv").is_file()  # in the venv, not site-packages
    assert f"--no-deps --target {python.parent.parent / lock_module.UV_FOLDER} {lock_module.UV}" in \
        (tmp_path / "calls").read_text()
    call = (tmp_path / "uv_call").read_text().split()
    assert call[:2] == ["pip", "install"] and call[call.index("--python") + 1] == str(python)
    for option in ("--no-config", "--no-deps"):
        assert option in call, option
    assert "--compile-bytecode" not in call  # Python compiles what the tests import, when they import it
    assert call[call.index("--find-links") + 1] == "/opt/wheels"
    assert (tmp_path / "uv_pins").read_text().split() == ["torch==2.14.1", "numpy==2.4.6"]
    # installed once: the next install uses it
    (tmp_path / "calls").write_text("")
    assert lock_module.uv_install(str(python), ["numpy==2.4.6"]) == 0
    assert "--target" not in (tmp_path / "calls").read_text()


def test_uv_that_cannot_be_had_or_fails_says_why(tmp_path, capsys):
    python = _fake_venv_python(tmp_path, 'echo "WARNING: Location x is ignored"; echo "ERROR: no network"; exit 1')
    assert lock_module.uv_install(str(python), ["torch==2.14.1"]) == 1
    err = capsys.readouterr().err
    assert f"could not install {lock_module.UV} (pip exit 1)" in err and "ERROR: no network" in err
    assert "WARNING: Location" not in err
    uv = python.parent.parent / lock_module.UV_FOLDER / "bin" / "uv"
    uv.parent.mkdir(parents=True)
    uv.write_text("#!/bin/bash\necho 'error: no space left on device' >&2\nexit 2\n")
    uv.chmod(0o755)
    python.write_text("#!/bin/bash\nexit 0\n")
    assert lock_module.uv_install(str(python), ["torch==2.14.1"]) == 2
    assert "uv failed (exit 2):\nerror: no space left on device" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["other_environment", "stale", "missing", "unreadable", "parallel_failed"])
def test_install_falls_back_to_the_resolver_and_says_why(recorded, case):
    if case == "other_environment":
        _write_lock(lock_module.LOCK, "python 3.9 darwin arm64")
        expected = f"requirements-lock.txt is for python 3.9 darwin arm64, this is {lock_module.environment()}"
    elif case == "stale":
        _write_lock(lock_module.LOCK, lock_module.environment(), torch_version="2.13.0")
        expected = ("requirements-lock.txt is stale (torch==2.14.1 (requirements-test.txt:1) is 2.13.0 in the lock); "
                    "rewrite it with `python scripts/requirements_lock.py write`")
    elif case == "missing":
        expected = "cannot use the lock: [Errno 2] No such file or directory"
    elif case == "unreadable":
        lock_module.LOCK.write_text(f"# environment: {lock_module.environment()}\ntorch\n")
        expected = "cannot use the lock: "
    else:
        _write_lock(lock_module.LOCK, lock_module.environment())
        recorded["uv_status"] = 1
        recorded["parallel_status"] = 1
        expected = "the parallel install of requirements-lock.txt failed (exit 1)"
    assert lock_module.install("py", 2) == 0
    assert len(recorded["resolving"]) == 1 and recorded["resolving"][0].startswith(expected), recorded["resolving"]
    assert len(recorded["check"]) == 1  # pip check runs after the resolver too


def test_pip_check_failing_fails_the_install(recorded, monkeypatch, capsys):
    _write_lock(lock_module.LOCK, lock_module.environment())

    class Broken:
        returncode, stdout, stderr = 1, "albumentations 2.0.8 requires albucore, which is not installed.\n", ""

    monkeypatch.setattr(lock_module.subprocess, "run", lambda command, **kw: Broken)
    assert lock_module.install("py", 2) == 1
    assert "requires albucore" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="the lock is written for Linux")
def test_the_makefile_installs_the_lock_and_remakes_the_venv_when_it_changes():
    makefile = (lock_module.ROOT / "Makefile").read_text()
    stamp_rule = next(line for line in makefile.splitlines() if line.startswith("$(STAMP):"))
    assert "requirements-lock.txt" in stamp_rule
    assert "$(PY) scripts/requirements_lock.py install" in makefile
