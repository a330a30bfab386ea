"""No network at run time: a short training and an evaluation under a socket guard make no connection
attempt (and the guard does catch one: albumentations' update check without syncseg's switch)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Installed as sitecustomize.py in a folder put first on PYTHONPATH: Python imports it at start-up in
# the process and in every spawned child, before any application code. Every name lookup and every
# internet-socket connection is recorded (with the stack) and refused; Unix sockets are local.
GUARD = '''
import os, socket, traceback

_LOG = os.environ["NETWORK_GUARD_LOG"]


def _refuse(what):
    with open(_LOG, "a") as file:
        file.write(f"pid {os.getpid()}: {what}\\n{''.join(traceback.format_stack(limit=12))}---\\n")
    raise OSError(101, f"network blocked by the test guard ({what})")


def _guarded(method):
    def guarded(self, address, *args):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            _refuse(f"{method.__name__} {address!r}")
        return method(self, address, *args)
    return guarded


socket.socket.connect = _guarded(socket.socket.connect)
socket.socket.connect_ex = _guarded(socket.socket.connect_ex)
socket.socket.sendto = _guarded(socket.socket.sendto)
for _name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    setattr(socket, _name, lambda host, *args, _name=_name, **kwargs: _refuse(f"{_name} {host!r}"))
'''


@pytest.fixture
def guarded_env(tmp_path):
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    (guard_dir / "sitecustomize.py").write_text(GUARD)
    log = tmp_path / "network.log"
    env = dict(os.environ, PYTHONPATH=f"{guard_dir}{os.pathsep}{ROOT}", NETWORK_GUARD_LOG=str(log),
               OMP_NUM_THREADS="1")
    for name in ("NO_ALBUMENTATIONS_UPDATE", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(name, None)
    return env, log


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_guard_catches_albumentations_update_check_and_the_data_package_switches_it_off(guarded_env):
    env, log = guarded_env
    process = _run(["-c", "import albumentations"], env)
    assert process.returncode == 0, process.stderr[-2000:]
    assert "getaddrinfo" in log.read_text()  # the guard sees what albumentations does on its own
    log.unlink()
    process = _run(["-c", "import syncseg.data.transforms, albumentations, os; print(os.environ['NO_ALBUMENTATIONS_UPDATE'])"],
                   env)
    assert process.returncode == 0 and process.stdout.strip() == "1", process.stderr[-2000:]
    assert not log.exists()


@pytest.mark.slow
def test_train_and_eval_make_no_connection_attempt(guarded_env, tmp_path):
    env, log = guarded_env
    run_dir = tmp_path / "run"
    tiny = ["data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=8",
            "data.synthetic_val_size=2", "data.num_workers=1", "model.head_channels=16", "model.aspp_rates=1",
            "train.batch_size=4", "train.iters=2", "train.val_interval=2", "train.log_interval=1",
            "eval.batch_size=2", "train.num_vis_images=1"]
    process = _run(["train.py", "--config", "demo.yaml", f"output_dir={run_dir}", *tiny], env)
    assert process.returncode == 0, process.stderr[-3000:]
    process = _run(["eval.py", "--checkpoint", str(run_dir / "best.pt"), "--device", "cpu", "--no-progress",
                    "data.num_workers=1"], env)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "mIoU" in process.stdout
    assert not log.exists(), log.read_text()[:3000]
