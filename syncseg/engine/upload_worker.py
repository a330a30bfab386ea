"""The process that uploads a run dir's files to object storage, beside the training process.

    python -m syncseg.engine.upload_worker URL      (started by syncseg.engine.remote_run_dir, never by hand)

Uploading in a thread of the training process cost 30% of the step time on 2 cores (benchmarks/
bench_tracking.py): s3fs's event loop and checksums take the GIL between the ops that the training's Python
thread dispatches. In a process of its own, at a lower priority (NICE), an upload takes only the CPU the
training leaves idle.

Protocol: one JSON line per file on stdin, {"local": PATH, "remote": PATH in URL's filesystem}; one JSON
line back per file, {"error": null} or {"error": "one line"}. It exits at the end of its input, and with the
thread that started it (Linux's PR_SET_PDEATHSIG): a killed training never leaves an upload running that
could finish after another machine has taken the run dir over.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path

NICE = 10
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's death closes stdin, which ends the loop
        pass


def lower_priority() -> None:
    """SCHED_IDLE where Linux offers it (the process runs only on CPU time nothing else wants, and yields
    at once when a training thread wakes up), else nice NICE."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.nice(NICE)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return 1
    lower_priority()
    from syncseg.engine.object_store import filesystem, put_atomically

    fs, _ = filesystem(argv[0])
    for line in sys.stdin:
        job = json.loads(line)
        try:
            put_atomically(fs, Path(job["local"]), job["remote"])
            answer = {"error": None}
        except OSError as error:
            answer = {"error": str(error)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
