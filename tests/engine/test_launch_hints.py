"""syncseg/engine/launch_hints.py: the command that continues a stopped run (the launch's own form) and the lost-peer line."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncseg.engine import launch_hints
from syncseg.engine.distributed import DistInfo, Launch


def _args(**values) -> argparse.Namespace:
    return argparse.Namespace(**{"config": "voc.yaml", "resume": None, "gpus": None, "overrides": [], **values})


@pytest.fixture
def agent(tmp_path):
    """A process started the way torchrun is (`torchrun --nnodes 1:3 ...`): its command line is the hint."""
    script = tmp_path / "torchrun"
    script.write_text("import time\ntime.sleep(60)\n")
    argv = [sys.executable, str(script), "--nnodes", "1:3", "--nproc_per_node", "2", "--max-restarts", "3",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "node01:29500", "--rdzv-id", "seg 42", "train.py",
            "--config", "voc.yaml", "output_dir=/shared/runs/voc"]
    process = subprocess.Popen(argv)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pid}/cmdline").read_bytes().count(b"\0") < len(argv) - 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield process.pid
    process.kill()
    process.wait()


def test_the_torchrun_hint_is_the_agents_own_command_with_its_elastic_nnodes(agent):
    info = DistInfo(launch=Launch(launcher="torchrun", world_size=4, num_nodes=2, local_world_size=2, elastic=True))
    hint = launch_hints.resume_command(_args(), info, parent=agent)
    assert "--nnodes 1:3" in hint and "--rdzv-endpoint node01:29500" in hint and "'seg 42'" in hint
    assert hint.endswith("train.py --config voc.yaml output_dir=/shared/runs/voc")
    assert "--nnodes 2" not in hint


def test_without_a_readable_agent_the_torchrun_hint_is_built_from_the_launch(tmp_path):
    info = DistInfo(launch=Launch(launcher="torchrun", world_size=4, num_nodes=2, local_world_size=2))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hint = launch_hints.resume_command(_args(), info, parent=other.pid)
    finally:
        other.kill()
        other.wait()
    assert "-m torch.distributed.run --nnodes 2 --nproc_per_node 2" in hint and "--resume auto" in hint


def test_srun_tasks_get_an_srun_hint():
    info = DistInfo(launch=Launch(launcher="slurm", world_size=2))
    hint = launch_hints.resume_command(_args(), info)
    assert hint.startswith("srun ") and "torch.distributed.run" not in hint and "--resume auto" in hint


def test_the_lost_peer_line_quotes_the_backends_message_whole_and_fits_the_launcher():
    backend = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
               "[10.213.7.2]:47713 while waiting for the remote side of an all-reduce of 4 tensors to answer")
    error = RuntimeError(backend + "\nException raised from recvBytes at ...")
    line = launch_hints.lost_contact_message(error, rank=1, timeout_s=20, launcher="slurm")
    assert backend in line and "recvBytes" not in line and "\n" not in line
    assert "scontrol requeue" in line and "torchrun" not in line and "dist.timeout_s=20" in line
    assert "--max-restarts" in launch_hints.lost_contact_message(error, rank=0, timeout_s=20, launcher="torchrun")
