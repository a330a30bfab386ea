"""The shipped scripts/slurm/train.sbatch under a real Slurm (tests/e2e/slurm_cluster.py: one private node):
2 srun tasks on gloo, cancelled, requeued, its rendezvous host killed, and resumed each time to the losses of
an uninterrupted run of the same shape (the batch script's command in 2 forked processes).

Slurm holds a requeued job back for two minutes; the test starts it at once (`SlurmCluster.release`), as
an operator could. Skips, with the reason in one line, where this machine cannot run Slurm."""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.common import ROOT, TINY_BASE, read_metrics, train_forked
from tests.e2e.slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_slurm_installed
from tests.gloo import free_port, torchrun_environment

SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"
ITERS = 12
TINY = [*TINY_BASE, "data.num_workers=1", "data.synthetic_val_size=4", "eval.batch_size=4", "model.channels_last=false",
        "train.amp=off", "eval.amp=off", "train.warmup_iters=2", f"train.iters={ITERS}", "train.val_interval=1000",
        "train.ckpt_interval=1000"]
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture
def slurm():
    if os.geteuid() != 0:
        pytest.skip("a private Slurm needs root (its daemons run as root)")
    try:
        ensure_slurm_installed()
    except SlurmUnavailable as error:
        pytest.skip(f"cannot run Slurm here: {error}")
    cluster = SlurmCluster(cpus=4)
    try:
        cluster.start()
    except BaseException as error:
        cluster.stop()
        cluster.remove()
        if isinstance(error, SlurmUnavailable):
            pytest.skip(f"cannot run Slurm here: {error}")
        raise
    try:
        yield cluster
    finally:
        cluster.stop()
        cluster.remove()


class Job:
    """One sbatch job and its log, which every restart appends to (--open-mode=append)."""

    def __init__(self, cluster: SlurmCluster, run_dir: Path, log: Path) -> None:
        self.cluster, self.run_dir, self.log = cluster, run_dir, log
        env = {key: value for key, value in cluster.env.items() if not key.startswith(("TORCHELASTIC_", "MASTER_"))
               and key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        self.id = cluster.command("sbatch", "--parsable", f"--output={log}", "--ntasks-per-node=2",
                                  "--gpus-per-node=0", str(SCRIPT), "demo.yaml", str(run_dir), *TINY, cwd=ROOT,
                                  env={**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}).strip().split(";")[0]
        self.mark = 0  # where the current run's lines start in the log

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def segment(self) -> str:
        """The log since the last `next_run()`."""
        return self.text()[self.mark:]

    def next_run(self) -> None:
        self.mark = len(self.text())

    def wait_for(self, pattern: str, *, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while (match := re.search(pattern, self.segment())) is None:
            state = self.cluster.job(self.id)["JobState"]
            assert state not in ENDED and time.monotonic() < deadline, \
                f"job {self.id} ({state}): no {pattern!r} after {timeout:g} s:\n{self.segment()[-3000:]}"
            time.sleep(0.2)
        return match

    def wait_iteration(self, iteration: int, *, timeout: float = 90) -> None:
        self.wait_for(rf"\[rank 0\] syncseg\.engine\.trainer: iter {iteration}/{ITERS}", timeout=timeout)

    def wait_ended(self, *, timeout: float = 60) -> dict[str, str]:
        """scontrol's record once the job has left the queue (its batch script has exited)."""
        deadline = time.monotonic() + timeout
        while self.id in self.cluster.command("squeue", "-h", "-o", "%i").split():
            assert time.monotonic() < deadline, f"job {self.id} still queued after {timeout:g} s"
            time.sleep(0.2)
        return self.cluster.job(self.id)

    def wait_requeued(self, restarts: int, *, timeout: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (record := self.cluster.job(self.id))["Restarts"] != str(restarts) or record["JobState"] != "PENDING":
            assert record["JobState"] not in ENDED and time.monotonic() < deadline, \
                f"job {self.id} not requeued (Restarts={restarts}): {record}\n{self.segment()[-3000:]}"
            time.sleep(0.2)
        return record

    def resume(self, iteration: int) -> None:
        """Start the requeued job now; assert it resumes last.pt at `iteration`."""
        self.next_run()
        self.cluster.release(self.id)
        self.wait_for(rf"resuming \S+ at iteration {iteration}\b", timeout=90)

    def saved_iteration(self) -> int:
        return int(torch.load(self.run_dir / "last.pt", map_location="cpu", weights_only=True)["iteration"])


def _requested_iteration(log: str) -> int:
    """The iteration rank 0 was in when it logged the signal: the one its line names, or the one after the
    last iteration it logged before that line."""
    received = re.search(r".*\[rank 0\] syncseg\.engine\.signals: received SIGTERM.*", log)
    assert received, log[-3000:]
    named = re.search(r"iteration (\d+)", received.group(0))
    if named:
        return int(named.group(1))
    return max(int(n) for n in re.findall(r"\[rank 0\] syncseg\.engine\.trainer: iter (\d+)/", log[:received.start()])) + 1


def _stopped_at_request(job: Job) -> tuple[int, int]:
    """(requested, saved) after a stop: last.pt is at the iteration the signal came in, or the next; every
    task exited 143 by itself, none was killed (srun prints one line per task status), no traceback."""
    log = job.segment()
    requested, saved = _requested_iteration(log), job.saved_iteration()
    assert saved in (requested, requested + 1), (requested, saved)
    assert f"stopped by SIGTERM at iteration {saved}; saved" in log
    tasks = re.findall(r"srun: error: \S+: tasks? ([\d,-]+): (.+)", log)
    assert {status for _, status in tasks} == {"Exited with exit code 143"}, log[-3000:]
    assert {task for spec, _ in tasks for task in re.findall(r"\d+", spec)} == {"0", "1"}, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return requested, saved


def _rank_pid(cluster: SlurmCluster, rank: int) -> int:
    """The pid of train.py's rank `rank` (a child of slurmstepd, not one of its DataLoader workers)."""
    for line in cluster.processes():
        pid = int(line.split()[0])
        parent = Path(f"/proc/{Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[1]}/cmdline")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if "train.py" in line and f"SLURM_PROCID={rank}".encode() in environ and \
                parent.read_bytes().startswith(b"slurmstepd"):
            return pid
    raise AssertionError(f"no rank {rank} among {cluster.processes()}")


def _losses(run_dir: Path) -> dict[int, float]:
    records = read_metrics(run_dir)
    return {record["iteration"]: record["loss"] for record in records if record["type"] == "train"}


def _uninterrupted(run_dir: Path) -> Path:
    """The job's run without interruptions: the batch script's srun command (its arguments, 2 ranks, one OpenMP
    thread, the repository as the folder) as train's main in 2 forked ranks with the variables a launcher gives
    them (tests.e2e.common.train_forked). The reference's claim is its losses, not Slurm's: as a second sbatch job
    its 2 tasks each paid ~5 CPU-s of imports."""
    train_forked(run_dir, ["--resume", "auto", "--config", "demo.yaml", f"output_dir={run_dir}", *TINY],
                 torchrun_environment(2, free_port()))
    return run_dir


@pytest.mark.slow
def test_sbatch_cancel_requeue_and_lost_rank_resume_to_the_uninterrupted_losses(slurm, tmp_path):
    start = time.monotonic()
    job = Job(slurm, tmp_path / "run", tmp_path / "run.log")

    # scancel: the tasks save and exit 143, Slurm records the job CANCELLED with that status, no requeue
    job.wait_iteration(3)
    sent = time.time()
    slurm.command("scancel", job.id)
    record = job.wait_ended(timeout=45)
    ended = time.time() - sent
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("CANCELLED", "143:0", "0"), record
    requested, saved = _stopped_at_request(job)
    saved_after = (job.run_dir / "last.pt").stat().st_mtime - sent
    assert saved_after < 30  # inside Slurm's KillWait
    log = job.segment()
    assert re.search(r"train\.sbatch: job \d+: step exited 143 after scancel", log.strip().splitlines()[-1]), log
    figures = [f"scancel during iteration {requested}: last.pt at {saved}, {saved_after:.1f} s after the signal; "
               f"job ended {ended:.1f} s after it: {record['JobState']} {record['ExitCode']}"]

    # requeued (by an operator here; by Slurm itself after a preemption): resumes from last.pt
    slurm.command("scontrol", "requeue", job.id)
    job.resume(saved)
    figures.append(f"requeued: Restarts={slurm.job(job.id)['Restarts']}, resumed at iteration {saved}")

    # rank 0 (it serves the rendezvous store) killed: the step fails, last.pt is there, the script requeues
    job.wait_iteration(saved + 2)
    os.kill(_rank_pid(slurm, 0), signal.SIGKILL)
    record = job.wait_requeued(2)
    failed = re.search(r"step exited (\d+); requeuing", job.segment())
    assert failed and job.saved_iteration() == saved, job.segment()[-3000:]
    figures.append(f"rank 0 killed: step exited {failed.group(1)}, requeued by the script: {record['JobState']} "
                   f"Restarts={record['Restarts']} ExitCode={record['ExitCode']}")

    job.resume(saved)
    record = job.wait_ended(timeout=90)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "2"), record
    assert job.saved_iteration() == ITERS
    expected = _losses(_uninterrupted(tmp_path / "reference"))
    assert sorted(expected) == list(range(1, ITERS + 1)) and len(set(expected.values())) > 1
    assert _losses(job.run_dir) == expected  # float32, the same 2-task split: exact

    leftovers = slurm.stop()
    assert leftovers == [], leftovers
    print("\n".join([*figures, f"resumed at iteration {saved}; test {time.monotonic() - start:.0f} s"]))
