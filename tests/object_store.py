"""An S3-compatible server for the tests: moto's server mode on a free loopback port, started and stopped by the
test (bounded in time), and the environment that points s3fs and boto3 at it."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

from tests.servers import free_port, serve

SERVER_START_S = 60  # moto_server answers in about 2 s on the 2-core VM


@contextlib.contextmanager
def s3_server(folder: Path, *, authenticate: bool = False,
              preexec_fn: Callable[[], None] | None = None) -> Iterator[dict[str, str]]:
    """A moto S3 server; yields the environment a client needs (endpoint, region, test credentials). With
    `authenticate`, the server checks credentials (moto's IAM enforcement): the test keys are then unknown to it."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ}
    if authenticate:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    endpoint = f"http://127.0.0.1:{port}"
    with serve([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
               f"{endpoint}/moto-api/", log=folder / f"moto-{port}.log", start_s=SERVER_START_S, env=env,
               preexec_fn=preexec_fn):
        yield {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def s3_client(env: dict[str, str]):
    """A boto3 client on the test server (to create buckets and read objects back independently of s3fs)."""
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])
