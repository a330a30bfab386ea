"""What the multi-process tests share: a free loopback port, a bounded gloo process group, and ranks forked from
a forkserver (start_ranks; run_module_ranks for a module's main, such as a training rank's)."""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
from multiprocessing import forkserver
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
STACKS_SIGNAL = signal.SIGUSR1  # a rank of run_module_ranks prints its threads' Python stacks on it


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, *, timeout_s: float = 60) -> None:
    """Join the gloo group of `world_size` processes on 127.0.0.1:`port`; every collective is bounded by
    `timeout_s` (a hung peer fails the test instead of hanging it)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


# What the ranks of the app's multi-process tests import before their worker runs (start_ranks): torch,
# torchvision and the engine's distributed module for the layer and collective tests, the trainer (albumentations,
# cv2) for the training ranks of run_module_ranks. A training process spends ~4.5 of its ~6.5 CPU-s importing
# these (torch._dynamo among them: any optimizer's add_param_group imports it); the server pays it once.
_SERVER_ENVIRONMENT: dict[str, str] | None = None  # os.environ when this process's forkserver started
PRELOAD = ["torch", "torch.distributed", "torchvision", "pytest", "syncseg.model.sync_batchnorm",
           "syncseg.engine.distributed", "syncseg.engine.launch_hints", "syncseg.engine.trainer",
           "syncseg.engine.run_plan"]


def start_method() -> str:
    """"forkserver" where the platform has it, else "spawn". Either way each rank is a fresh process that never
    ran a test (no process group, torch's defaults), but the forkserver imports torch, torchvision and the
    engine once per pytest worker and forks every rank from there, where "spawn" starts a new interpreter per
    rank that imports them again (~3-4.5 CPU-s a rank: test_large_world's 16 ranks took 42 CPU-s)."""
    global _SERVER_ENVIRONMENT
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    if _SERVER_ENVIRONMENT is None:  # the server starts with the first forkserver process, right after this
        mp.set_forkserver_preload(PRELOAD)
        _SERVER_ENVIRONMENT = dict(os.environ)
    if _test_independent(os.environ) != _test_independent(_SERVER_ENVIRONMENT):
        # a forkserver's ranks get the environment it started with, not the caller's: where it changed since
        # (a test's monkeypatch.setenv; importing syncseg.data sets NO_ALBUMENTATIONS_UPDATE), the server is
        # stopped, and the next rank starts a new one with this environment (no rank of the old one runs: every
        # test waits for its ranks); where it cannot be stopped, the ranks are spawned
        server = getattr(forkserver, "_forkserver", None)
        if not callable(getattr(server, "_stop", None)):
            return "spawn"
        server._stop()
        _SERVER_ENVIRONMENT = dict(os.environ)
    return "forkserver"


def _test_independent(environment) -> dict[str, str]:
    """The environment without PYTEST_CURRENT_TEST, which pytest sets to each test's name as it runs it: compared
    with it, every test but the one that started the server stopped it."""
    return {key: value for key, value in environment.items() if key != "PYTEST_CURRENT_TEST"}


def start_ranks(worker, args: tuple, nprocs: int, *, join: bool = True):
    """torch.multiprocessing.start_processes(worker, args, nprocs) with start_method(): `join=True` waits
    and raises the first rank's exception, as mp.spawn does; `join=False` returns the context."""
    return mp.start_processes(worker, args=args, nprocs=nprocs, join=join, start_method=start_method())


LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def plain_environment() -> dict[str, str]:
    """os.environ without a launcher's variables (torchrun's, TORCHELASTIC_*, SLURM_*), one OpenMP thread."""
    return {**{key: value for key, value in os.environ.items()
               if not key.startswith(("TORCHELASTIC_", "SLURM_")) and key not in LAUNCHER_VARIABLES},
            "OMP_NUM_THREADS": "1"}


def torchrun_environment(world_size: int, port: int) -> list[dict[str, str]]:
    """Each rank's environment as torchrun gives its workers on one host (WORLD_SIZE, RANK, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) on top of plain_environment()."""
    return [{**plain_environment(), "WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            for rank in range(world_size)]


def _module_rank(rank: int, main, argv: list[str], environments: list[dict[str, str]], logs: list[str],
                 cwd: str) -> None:
    """One rank of run_module_ranks: exactly `environments[rank]` as its environment, `cwd` as its folder, its
    stdout and stderr (descriptors 1 and 2) in `logs[rank]`, then `main(argv)`; a non-zero return is its exit
    status."""
    os.chdir(cwd)
    # a forkserver's child inherits "forkserver" as its default start method, and its DataLoader workers would
    # each import torch again (3 s to the first batch): the platform's default, as a new interpreter has it
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(environments[rank])
    log = os.open(logs[rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # SIGUSR1 prints every thread's Python stack into the log: run_module_ranks sends it to a rank and its
    # processes that catch it (DataLoader workers forked from the rank keep the handler and the log; those of a
    # forkserver, in multi-process runs, do not) when they outlive the timeout, so a hang says where it is
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # read by OpenMP at the server's start
    try:
        code = main(list(argv))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        sys.exit(code)


def run_module_ranks(main, argv: list[str], environments: list[dict[str, str]], logs: list[Path], *,
                     cwd: Path = ROOT, timeout: float = 300) -> None:
    """Run `main(argv)` (a function at a module's top level, such as a test file's `main` that a rank runs as
    `python -m tests.e2e.test_x ARGV`) in len(environments) processes, rank i with exactly environments[i] as
    its environment, its output in logs[i] and `cwd` (the repository) as its folder, as that command would.
    The processes fork from the forkserver (start_ranks), where torch, torchvision and the trainer are
    imported once: a training rank started as a command imports them itself (~4.5 CPU-s). Waits up to
    `timeout` s; a rank that fails (an exception, a non-zero exit status) ends the others at once and fails
    the caller with its log's end."""
    logs = [str(log) for log in logs]
    context = start_ranks(_module_rank, (main, list(argv), environments, logs, str(cwd)), len(environments),
                          join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() >= deadline:
                _print_stacks([process.pid for process in context.processes], logs)
                raise AssertionError(f"ranks still running after {timeout} s (their stacks and their workers' are at "
                                     "their logs' ends):\n" + "\n".join(
                                         f"--- rank {rank} ({log}):\n{Path(log).read_text()[-12000:]}"
                                         for rank, log in enumerate(logs)))
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        raise AssertionError(f"rank {error.error_index} failed: {error}\n--- its log ({logs[error.error_index]}):\n"
                             f"{Path(logs[error.error_index]).read_text()[-4000:]}") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def descendants(pids: list[int]) -> list[int]:
    """`pids` and every process below them (children, their children, ...), read from /proc (only `pids`
    where there is none)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone since the listing, or no /proc
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def _print_stacks(pids: list[int], logs: list[str]) -> None:
    """Ask the ranks `pids` and their processes that catch STACKS_SIGNAL (registered by _module_rank; a
    forked worker keeps it) to print their Python stacks into their `logs`, one process at a time: a rank and
    its workers share a log, and stacks written at once would interleave line by line. Each gets up to 3 s to
    start writing, and the logs must then stay quiet for 0.2 s."""
    def size() -> int:
        return sum(os.path.getsize(log) for log in logs if os.path.exists(log))

    for pid in descendants(pids):
        if not _catches(pid, STACKS_SIGNAL):  # e.g. a forkserver's own process: the signal would end it
            continue
        before = size()
        try:
            os.kill(pid, STACKS_SIGNAL)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 3
        while size() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        quiet = size()
        while time.monotonic() < deadline + 3:
            time.sleep(0.2)
            if size() == quiet:
                break
            quiet = size()


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its /proc status's SigCgt mask)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def environment_worker(rank: int, name: str, out: str) -> None:
    """A rank that writes what it sees of the environment variable `name` (tests/test_gloo.py)."""
    with open(out, "w") as file:
        file.write(os.environ.get(name, "<unset>"))


def start_method_main(argv: list[str]) -> int:
    """A main for run_module_ranks that writes the multiprocessing start method it would use (tests/test_gloo.py)."""
    Path(argv[0]).write_text(multiprocessing.get_start_method())
    return 0


def _hang_in_worker(parent: int) -> None:
    while os.getppid() == parent:  # until its rank is gone, as a DataLoader worker does
        time.sleep(0.1)


def _hang_in_rank() -> None:
    while True:
        time.sleep(0.1)


def hanging_main(argv: list[str]) -> int:
    """A main for run_module_ranks that never returns, with a forked worker process that waits as long
    (tests/test_gloo.py: a timeout prints both stacks)."""
    worker = multiprocessing.get_context("fork").Process(target=_hang_in_worker, args=(os.getpid(),), daemon=True)
    worker.start()
    Path(argv[0]).write_text(str(worker.pid))
    _hang_in_rank()
    return 0
