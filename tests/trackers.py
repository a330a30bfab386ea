"""What the tracker tests share: a real `mlflow server` on loopback (SQLite backend), and a W&B offline run's
records read back from its .wandb file."""
from __future__ import annotations

import contextlib
import os
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from tests.servers import free_port, serve

SERVER_START_S = 90  # what `mlflow server` may take to answer /health (about 6 s on the 2-core VM)


@contextlib.contextmanager
def mlflow_server(folder: Path, *, preexec_fn: Callable[[], None] | None = None) -> Iterator[str]:
    """`mlflow server` with a SQLite store and artifacts in `folder`, on a free loopback port; yields its URI and
    stops it (tests.servers.serve)."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", f"sqlite:///{folder / 'server.db'}", "--artifacts-destination",
               str(folder / "artifacts"), "--workers", "1"]
    # without its job runner: seven huey consumers that would take both cores from the training under test
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    uri = f"http://127.0.0.1:{port}"
    with serve(command, f"{uri}/health", log=folder / "server.log", start_s=SERVER_START_S, env=env, cwd=folder,
               preexec_fn=preexec_fn):
        yield uri


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
