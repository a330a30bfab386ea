"""What the tracker tests share: a real `mlflow server` on loopback (SQLite backend), and a W&B offline run's
records read back from its .wandb file."""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

SERVER_START_S = 90  # what `mlflow server` may take to answer /health (about 6 s on the 2-core VM)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """`mlflow server` with a SQLite store and artifacts in `folder`, on a free loopback port; yields its URI and
    stops it (SIGTERM, then SIGKILL after 10 s)."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", f"sqlite:///{folder / 'server.db'}", "--artifacts-destination",
               str(folder / "artifacts"), "--workers", "1"]
    log = (folder / "server.log").open("w")
    # without its job runner: seven huey consumers that would take both cores from the training under test
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True,
                              env=env)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({server.returncode}): {(folder / 'server.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not answer within {SERVER_START_S} s") from None
                time.sleep(0.3)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 15)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
        log.close()


BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) framed records
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[Any]:
    """Every protobuf Record of one W&B run file (run-<id>.wandb), in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, bodies, pieces = 7, [], b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        body = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == FULL:
            bodies.append(body)
        elif kind == FIRST:
            pieces = body
        elif kind == MIDDLE:
            pieces += body
        elif kind == LAST:
            bodies.append(pieces + body)
    records = []
    for body in bodies:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(body)
        records.append(record)
    return records


def wandb_history(path: Path) -> list[dict[str, str]]:
    """The history rows (what run.log sent) of a W&B run file: key -> JSON text of the value."""
    return [{item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            for record in wandb_records(path) if record.WhichOneof("record_type") == "history"]


def wandb_run_record(path: Path) -> Any:
    """The `run` record of a W&B run file (its id, name, project and config)."""
    return next(record.run for record in wandb_records(path) if record.WhichOneof("record_type") == "run")
