"""A real server on loopback for the tests (and the benchmarks that borrow them): started in its own process group,
polled until it answers, stopped with SIGTERM and then SIGKILL, each step bounded in time."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Sequence

STOP_S = 10  # SIGTERM, then SIGKILL after this long


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serve(command: Sequence[str], probe_url: str, *, log: Path, start_s: float, env: dict[str, str] | None = None,
          cwd: Path | None = None, preexec_fn: Callable[[], None] | None = None) -> Iterator[subprocess.Popen]:
    """Run `command` (its output in `log`) until `probe_url` answers, at most `start_s` seconds (RuntimeError naming
    the server and its log when it exits or stays silent); yields the process, and stops its whole group after.
    `preexec_fn` runs in the child before the command (bench_tracking lowers its priority there)."""
    name = Path(command[0]).name
    with log.open("w") as output:
        server = subprocess.Popen(list(command), stdout=output, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                  start_new_session=True, preexec_fn=preexec_fn)
        try:
            deadline = time.monotonic() + start_s
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"{name} exited ({server.returncode}): {log.read_text()[-3000:]}")
                try:
                    with urllib.request.urlopen(probe_url, timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not answer within {start_s} s (log: {log})") from None
                    time.sleep(0.2)
            yield server
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, 15)
            try:
                server.wait(STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
                server.wait()
