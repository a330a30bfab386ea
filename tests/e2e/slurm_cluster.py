"""A private one-node Slurm for the tests: munged, slurmctld and slurmd of Debian's slurm-wlm, started as
root in a folder of their own (config, keys, state, spool, logs) on free loopback ports, and stopped with
everything they ran.

`SlurmCluster.start()` raises `SlurmUnavailable` (a one-line reason, with the tail of a daemon's log when
one would not start) where this machine cannot run Slurm; tests skip on it, never fail."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.gloo import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo")
INSTALL_TIMEOUT_S = 300


class SlurmUnavailable(Exception):
    """This machine cannot run a private Slurm (the message says why, in one line)."""


def _sbin(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def ensure_slurm_installed() -> None:
    """Find slurm-wlm and munge, or install them with apt-get (root only; an `apt-get update` first when the
    package is unknown, as in images shipped without package lists), all within INSTALL_TIMEOUT_S."""
    programs = (*DAEMONS, *COMMANDS)
    if all(_sbin(name) for name in programs):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable("slurm-wlm and munge are not installed, and installing them needs root and apt-get")
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = None
    for command in (["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], ["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]):
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=env,
                                    timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"installing slurm-wlm and munge took over {INSTALL_TIMEOUT_S} s") from None
        if command[1] == "install" and result.returncode == 0:
            break
    missing = [name for name in programs if not _sbin(name)]
    if missing:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SlurmUnavailable(f"apt-get install slurm-wlm munge: exit {result.returncode}, "
                               f"{', '.join(missing)} missing: {tail[0]}")


def _config(state: Path, *, host: str, cpus: int) -> str:
    return "\n".join([
        "ClusterName=syncsegtest", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={state}/munge/munge.sock",
        f"StateSaveLocation={state}/ctld", f"SlurmdSpoolDir={state}/spool", f"PlugStackConfig={state}/plugstack.conf",
        f"SlurmctldPidFile={state}/slurmctld.pid", f"SlurmdPidFile={state}/slurmd.pid",
        f"SlurmctldLogFile={state}/log/slurmctld.log", f"SlurmdLogFile={state}/log/slurmd.log",
        # no cgroups: processes are tracked by process group, tasks are not bound
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SwitchType=switch/none",
        # as on a production cluster: requeue allowed, 30 s between SIGTERM and SIGKILL
        "JobRequeue=1", "KillWait=30",
        # finished jobs stay visible to `scontrol show job` (no accounting database here); pending jobs are
        # looked at every second
        "MinJobAge=3600", "SchedulerParameters=sched_interval=1", "ReturnToService=2",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP", "",
    ])


class SlurmCluster:
    """One node named `hostname -s`, `cpus` CPUs (more than the machine has: the node is oversubscribed)."""

    def __init__(self, *, cpus: int = 2) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="syncseg-slurm-"))
        self.conf = self.state / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.daemons: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm's commands: this cluster's config, no job's SLURM_* variables."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf)}

    def start(self, *, timeout: float = 30) -> None:
        try:  # srun's tasks meet at the first node's name (syncseg.engine.distributed.detect_launch)
            socket.gethostbyname(self.host)
        except OSError as error:
            raise SlurmUnavailable(f"the hostname {self.host!r} does not resolve ({error})") from None
        for folder in ("munge", "ctld", "spool", "log"):
            (self.state / folder).mkdir(mode=0o700)
        key = self.state / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (self.state / "plugstack.conf").write_text("")
        self.conf.write_text(_config(self.state, host=self.host, cpus=self.cpus))
        munge = self.state / "munge"
        self._daemon("munged", [_sbin("munged"), "--foreground", "--force", f"--socket={munge}/munge.sock",
                                f"--key-file={key}", f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed",
                                f"--log-file={self.state}/log/munged.log"], until=munge / "munge.sock")
        self._daemon("slurmctld", [_sbin("slurmctld"), "-D", "-f", str(self.conf)],
                     until=self.state / "slurmctld.pid")
        self._daemon("slurmd", [_sbin("slurmd"), "-D", "-f", str(self.conf)], until=self.state / "slurmd.pid")
        deadline = time.monotonic() + timeout
        while self.command("sinfo", "-h", "-N", "-o", "%T", check=False).strip() != "idle":
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"node {self.host} not idle after {timeout:g} s: {self.log_tail('slurmd')}")
            time.sleep(0.3)

    def _daemon(self, name: str, command: list, *, until: Path, timeout: float = 15) -> None:
        log = open(self.state / "log" / f"{name}.out", "w")
        with log:
            self.daemons[name] = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True)
        deadline = time.monotonic() + timeout
        while not until.exists():
            if self.daemons[name].poll() is not None or time.monotonic() > deadline:
                raise SlurmUnavailable(f"{name} did not start: {self.log_tail(name)}")
            time.sleep(0.1)

    def log_tail(self, name: str, lines: int = 3) -> str:
        text = ""
        for path in (self.state / "log" / f"{name}.log", self.state / "log" / f"{name}.out"):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:]) or "no log"

    def command(self, *args: str, check: bool = True, timeout: float = 30, **kwargs) -> str:
        """Run one of Slurm's commands against this cluster; its stdout."""
        result = subprocess.run(args, env=kwargs.pop("env", self.env), capture_output=True, text=True,
                                timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, ExitCode, Restarts, Reason, ...)."""
        fields = self.command("scontrol", "show", "job", "-o", job_id).split()
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def wait_job(self, job_id: str, states: tuple[str, ...], *, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] not in states:
            assert time.monotonic() < deadline, f"job {job_id} not {'/'.join(states)} after {timeout:g} s: {job}"
            time.sleep(0.3)
        return job

    def release(self, job_id: str, *, timeout: float = 60) -> None:
        """Start a requeued job now: Slurm holds one back for two minutes after a requeue (BeginTime)."""
        self.wait_job(job_id, ("PENDING",), timeout=timeout)
        self.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        self.wait_job(job_id, ("RUNNING", "COMPLETED"), timeout=timeout)

    def processes(self) -> list[str]:
        """`pid command` of every process started with this cluster's config (daemons, job steps, tasks)."""
        found = []
        marker = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"{proc.name} {command.strip()}")
        return found

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons and wait for them; the processes that had to be killed."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            jobs = self.command("squeue", "-h", "-o", "%i", check=False).split()
            if jobs:
                self.command("scancel", *jobs, check=False)
            deadline = time.monotonic() + 40  # KillWait=30, then SIGKILL
            while self.command("squeue", "-h", "-o", "%i", check=False).split() and time.monotonic() < deadline:
                time.sleep(0.3)
        for name in reversed(DAEMONS):
            daemon = self.daemons.pop(name, None)
            if daemon is not None and daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait(timeout=15)
        leftovers = self.processes()
        for line in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        return leftovers

    def remove(self) -> None:
        shutil.rmtree(self.state, ignore_errors=True)
