"""Training as clusters run it, on CPU with gloo: signals to the whole process group, torchelastic
restarts after a killed worker, a hung peer bounded by dist.timeout_s, two "hosts" in network
namespaces, Slurm's srun variables, and run-dir ownership.

Every comparison is against an uninterrupted run with the same settings; losses are read from
metrics.jsonl (train.log_interval=1)."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.common import read_metrics, train_forked
from tests.gloo import torchrun_environment

ROOT = Path(__file__).resolve().parents[2]
ITERS = 24
TINY = [
    "data.synthetic_image_size=32", "data.crop_size=32", "data.scale_range=0.9,1.1", "data.synthetic_train_size=32",
    "data.synthetic_val_size=4", "model.backbone=resnet18", "model.head_channels=16", "model.aspp_rates=1",
    "model.channels_last=false", "train.batch_size=4", "train.warmup_iters=2", "train.log_interval=1",
    "eval.batch_size=4", f"train.iters={ITERS}", "train.val_interval=1000", "train.ckpt_interval=1000",
]


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "TORCHELASTIC_")) and key not in
           ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    # torchrun restarts are flaky on torch 2.14 with the rendezvous store shared (docs/clusters.md: Several machines)
    return {**env, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **extra}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(processes: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *extra]


def _train_command(run_dir: Path, *overrides: str, launcher: list[str] | None = None) -> list[str]:
    return [*(launcher or [sys.executable]), str(ROOT / "train.py"), "--config", "demo.yaml", f"output_dir={run_dir}",
            *TINY, *overrides]


def _run(command: list[str], *, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _losses(run_dir: Path) -> dict[int, float]:
    records = read_metrics(run_dir)
    return {r["iteration"]: r["loss"] for r in records if r["type"] == "train"}


def _assert_same_losses(got: dict[int, float], expected: dict[int, float], *, tolerance: float = 1e-6) -> None:
    assert sorted(got) == sorted(expected) == list(range(1, ITERS + 1))
    for iteration in expected:
        assert got[iteration] == pytest.approx(expected[iteration], abs=tolerance, rel=0), iteration
    assert len(set(expected.values())) > 1  # the losses move: the comparison is not vacuous


def _wait_for(predicate, *, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out waiting for the training to get going"
        time.sleep(0.1)


def _logged_iterations(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"type": "train"') if path.is_file() else 0


def _no_traceback_of_ours(stderr: str) -> None:
    assert f'File "{ROOT / "train.py"}"' not in stderr and "[rank0]: Traceback" not in stderr, stderr[-3000:]
    assert f'File "{ROOT / "syncseg"}' not in stderr, stderr[-3000:]


def _train_forked(run_dir: Path, *overrides: str, environments: list[dict[str, str]]) -> None:
    """_train_command's run as train's main in forked ranks (tests.e2e.common.train_forked)."""
    train_forked(run_dir, _train_command(run_dir, *overrides)[2:], environments)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, dict[int, float]]:
    """Uninterrupted runs: one process with 2 DataLoader workers, and 2 processes with torchrun's variables
    (references: the launchers themselves are the tests below)."""
    root = tmp_path_factory.mktemp("straight")
    _train_forked(root / "single", "data.num_workers=2", environments=[_env()])
    _train_forked(root / "two", "data.num_workers=1", environments=torchrun_environment(2, _free_port()))
    return {"single": _losses(root / "single"), "two": _losses(root / "two")}


# ----------------------------------------------------------------------------------------------- signals
def _stop_with_group_signal(command: list[str], run_dir: Path, signum: int) -> tuple[subprocess.Popen, str, float]:
    process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        _wait_for(lambda: _logged_iterations(run_dir) >= 3, timeout=240, process=process)
        sent = time.monotonic()
        os.killpg(process.pid, signum)  # the whole process group, as Slurm, Kubernetes and Ctrl-C do
        _, stderr = process.communicate(timeout=120)
        return process, stderr, time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_group_signal_with_workers_saves_exits_128_plus_signum_and_resumes_exactly(tmp_path, straight, signum):
    run_dir = tmp_path / "run"
    process, stderr, seconds = _stop_with_group_signal(_train_command(run_dir, "data.num_workers=2"), run_dir, signum)
    assert process.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    stopped = torch.load(run_dir / "last.pt", map_location="cpu", weights_only=True)["iteration"]
    assert stopped == max(_losses(run_dir)) < ITERS
    line = next(line for line in stderr.splitlines() if "continue with:" in line)
    assert f"stopped by {signal.Signals(signum).name} at iteration {stopped}" in line
    assert os.path.relpath(sys.executable) in line or sys.executable in line  # the interpreter that ran
    assert "--resume auto" in line
    # the resume's claim is the run's (exact losses), not the launcher's: train's main, forked
    _train_forked(run_dir, "data.num_workers=2", "--resume", "auto", environments=[_env()])
    _assert_same_losses(_losses(run_dir), straight["single"])
    print(f"{signal.Signals(signum).name}: stopped at iteration {stopped}, exit {seconds:.1f} s after the signal")


@pytest.mark.slow
def test_group_sigterm_under_torchrun_saves_and_the_next_launch_resumes_by_itself(tmp_path, straight):
    run_dir = tmp_path / "run"
    command = _train_command(run_dir, "data.num_workers=1", launcher=_torchrun(2))
    process, stderr, _ = _stop_with_group_signal(command, run_dir, signal.SIGTERM)
    # torchrun itself reports its own SIGTERM with a traceback and exit 1; the workers exit 143
    assert process.returncode != 0
    _no_traceback_of_ours(stderr)
    stopped = torch.load(run_dir / "last.pt", map_location="cpu", weights_only=True)["iteration"]
    assert stopped == max(_losses(run_dir)) < ITERS
    assert f"stopped by SIGTERM at iteration {stopped}" in stderr and "-m torch.distributed.run" in stderr
    # The next launch, without --resume: under torchelastic (TORCHELASTIC_RUN_ID, which torchrun's agent sets; the
    # killed-worker test below shows its restarted workers resuming so) the run dir's last.pt is resumed. Its
    # claim is the ranks' (they resume by themselves, exactly), so they run train's main forked, with the variables
    # a fresh torchrun launch gives them: a second agent and its two workers cost ~15 CPU-s of imports.
    elastic = {"TORCHELASTIC_RUN_ID": f"next-launch-{os.getpid()}", "TORCHELASTIC_RESTART_COUNT": "0",
               "TORCHELASTIC_MAX_RESTARTS": "0"}
    _train_forked(run_dir, "data.num_workers=1",
                  environments=[{**environment, **elastic} for environment in torchrun_environment(2, _free_port())])
    assert f"at iteration {stopped}" in (run_dir.parent / f"{run_dir.name}.rank0.log").read_text()
    _assert_same_losses(_losses(run_dir), straight["two"])


# ------------------------------------------------------------------------------------- elastic restarts
@pytest.mark.slow
def test_a_killed_worker_restarts_and_resumes_from_the_last_checkpoint(tmp_path, straight):
    run_dir = tmp_path / "run"
    port = _free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--max-restarts=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=restart-{port}"]
    process = subprocess.Popen(_train_command(run_dir, "data.num_workers=1", "train.ckpt_interval=8",
                                              launcher=launcher),
                               cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        _wait_for(lambda: (run_dir / "last.pt").is_file(), timeout=240, process=process)
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                                                       text=True).stdout.split()]
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)
        killed_at = time.time()
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr[-4000:]
    assert torch.load(run_dir / "last.pt", map_location="cpu", weights_only=True)["iteration"] == ITERS
    resumed_at = re.search(r"resuming \S+ at iteration (\d+)", stderr)
    assert resumed_at and int(resumed_at.group(1)) == 8, stderr[-4000:]
    _assert_same_losses(_losses(run_dir), straight["two"])
    first_step = re.search(r"(\d\d):(\d\d):(\d\d) INFO \[rank 0\] syncseg.engine.trainer: iter 9/", stderr)
    if first_step:
        clock = time.localtime(killed_at)
        seconds = (int(first_step.group(1)) * 3600 + int(first_step.group(2)) * 60 + int(first_step.group(3))
                   - (clock.tm_hour * 3600 + clock.tm_min * 60 + clock.tm_sec))
        print(f"killed worker -> first resumed step: about {seconds} s; iterations redone: "
              f"{max(0, _killed_iteration(stderr) - 8)}")


def _killed_iteration(stderr: str) -> int:
    before_restart = stderr.split("resuming", 1)[0]
    return max((int(n) for n in re.findall(r"iter (\d+)/", before_restart)), default=0)


HUNG_PEER_TIMEOUT_S = 10  # the test waits it out; ranks in lockstep never wait on each other that long


@pytest.mark.slow
def test_a_hung_peer_ends_the_other_rank_within_the_timeout(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        _train_command(run_dir, "data.num_workers=0", "train.iters=100000", f"dist.timeout_s={HUNG_PEER_TIMEOUT_S}",
                       launcher=_torchrun(2)),
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stopped_pid = None
    try:
        _wait_for(lambda: _logged_iterations(run_dir) >= 2, timeout=240, process=process)
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                                                       text=True).stdout.split()]
        stopped_pid, survivor = workers[-1], workers[0]
        os.kill(stopped_pid, signal.SIGSTOP)
        start = time.monotonic()
        while time.monotonic() - start < 90 and Path(f"/proc/{survivor}").exists() and \
                "zombie" not in _process_state(survivor):
            time.sleep(0.2)
        waited = time.monotonic() - start
        os.kill(stopped_pid, signal.SIGCONT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if stopped_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_pid, signal.SIGCONT)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert waited < 90, "the surviving rank did not give up on the hung peer"
    assert f"dist.timeout_s={HUNG_PEER_TIMEOUT_S}" in stderr, stderr[-3000:]
    assert "lost contact with the other processes" in stderr, stderr[-3000:]
    print(f"SIGSTOP: the other rank exited {waited:.1f} s later (dist.timeout_s={HUNG_PEER_TIMEOUT_S})")


def _process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


# ------------------------------------------------------------------------------------------ two hosts
@contextlib.contextmanager
def _two_hosts():
    """Two "nodes": network namespaces joined by a veth pair, 10.213.N.1 and 10.213.N.2 (addresses inside them
    only), each with a hostname of its own that resolves to its own address on both, as on real nodes
    (`ip netns exec` mounts /etc/netns/<namespace>/hosts over /etc/hosts; `unshare --uts` gives the
    hostname). Yields (namespace, hostname, address) per node and the launcher prefix that runs a command
    on a node."""
    if shutil.which("ip") is None or shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root, iproute2 and unshare")
    tag = f"ss{os.getpid() % 100000}"
    hosts = [f"{tag}a", f"{tag}b"]
    names = [f"{tag}-node1", f"{tag}-node2"]
    subnet = f"10.213.{os.getpid() % 250}"
    commands = [["ip", "netns", "add", hosts[0]], ["ip", "netns", "add", hosts[1]],
                ["ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"],
                ["ip", "link", "set", f"{tag}va", "netns", hosts[0]], ["ip", "link", "set", f"{tag}vb", "netns", hosts[1]]]
    for host, device, last in ((hosts[0], f"{tag}va", 1), (hosts[1], f"{tag}vb", 2)):
        commands += [["ip", "-n", host, "addr", "add", f"{subnet}.{last}/24", "dev", device],
                     ["ip", "-n", host, "link", "set", device, "up"], ["ip", "-n", host, "link", "set", "lo", "up"]]
    netns_etc = Path("/etc/netns")
    created_etc = not netns_etc.exists()
    try:
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {' '.join(command)}: {result.stderr.strip()}")
        table = f"127.0.0.1 localhost\n{subnet}.1 {names[0]}\n{subnet}.2 {names[1]}\n"
        for host in hosts:
            (netns_etc / host).mkdir(parents=True, exist_ok=True)
            (netns_etc / host / "hosts").write_text(table)

        def on_node(index: int) -> list[str]:
            return ["ip", "netns", "exec", hosts[index], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                    names[index]]

        yield [(hosts[0], names[0], f"{subnet}.1"), (hosts[1], names[1], f"{subnet}.2")], on_node
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host], capture_output=True)
            shutil.rmtree(netns_etc / host, ignore_errors=True)
        if created_etc:
            with contextlib.suppress(OSError):
                netns_etc.rmdir()


def _succeed_all(processes: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Wait for every process (killing the rest if one wait fails), assert each exited 0; their stderr."""
    try:
        outputs = [process.communicate(timeout=timeout)[1] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, stderr in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    return outputs


@pytest.mark.slow
def test_two_hosts_in_network_namespaces_equal_two_processes_on_one_host(tmp_path, straight):
    """docs/clusters.md's multi-node command as written (same on both nodes, the endpoint by hostname, no
    --local-addr, no GLOO_SOCKET_IFNAME): it works where hostnames resolve to the nodes' own addresses."""
    run_dir = tmp_path / "run"
    with _two_hosts() as (hosts, on_node):
        processes = []
        for index in range(2):
            launcher = [*on_node(index), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                        "--nproc_per_node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-id",
                        "two-hosts", "--rdzv-endpoint", f"{hosts[0][1]}:29531"]
            processes.append(subprocess.Popen(_train_command(run_dir, "data.num_workers=1", launcher=launcher),
                                              cwd=ROOT, env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = _succeed_all(processes)
    assert any("DDP over 2 processes" in stderr for stderr in outputs)
    _assert_same_losses(_losses(run_dir), straight["two"], tolerance=1e-6)


# --------------------------------------------------------------------------------------------- Slurm
@pytest.mark.slow
def test_srun_tasks_without_torchrun_form_one_run(tmp_path, straight):
    run_dir = tmp_path / "run"
    slurm = {"SLURM_NTASKS": "2", "SLURM_NODELIST": "localhost", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "424242",
             "MASTER_PORT": str(_free_port())}
    # srun's tasks are plain processes with these variables: train.py's main forked from the forkserver
    _train_forked(run_dir, "data.num_workers=1",
                  environments=[_env(**slurm, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)) for rank in range(2)])
    output = (tmp_path / "run.rank0.log").read_text()
    assert "slurm: rank 0/2" in output and "DDP over 2 processes" in output
    _assert_same_losses(_losses(run_dir), straight["two"], tolerance=1e-6)


# -------------------------------------------------------------------------------------------- run dir
@pytest.mark.slow
def test_a_second_training_into_a_busy_run_dir_exits_at_once(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(_train_command(run_dir, "data.num_workers=0", "train.iters=100000"), cwd=ROOT,
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        _wait_for(lambda: _logged_iterations(run_dir) >= 1, timeout=240, process=first)
        # paused while the second one tries (it still holds the run dir; it would only burn the CPU the second
        # one's start-up needs), then let go: it must go on training
        os.killpg(first.pid, signal.SIGSTOP)
        start = time.monotonic()
        second = _run(_train_command(run_dir, "data.num_workers=0", "--resume", "auto"), timeout=120)
        elapsed = time.monotonic() - start
        logged = _logged_iterations(run_dir)
        os.killpg(first.pid, signal.SIGCONT)
        errors = [line for line in second.stderr.splitlines() if "error" in line.lower()]
        assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
        assert f"'{run_dir}' is in use by another training (host {socket.gethostname()}, pid {first.pid}" in errors[0]
        assert elapsed < 60  # at once: nothing but the start-up
        # the first training is untouched: it trains on, into the same metrics log
        _wait_for(lambda: _logged_iterations(run_dir) > logged, timeout=60, process=first)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
