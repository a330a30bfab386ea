"""Run dirs, checkpoints and data roots on object storage: against a real S3-compatible server (moto's server
mode) on loopback, started and stopped by the tests, and fsspec's in-memory filesystem for the upload order.

The store is read back with boto3, not with the s3fs that wrote it."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from syncseg.engine import object_store, remote_run_dir
from syncseg.engine.object_store import local_copy, local_data_root, put_atomically
from syncseg.engine.remote_run_dir import RemoteRunDir, RunDirBusy
from tests.e2e.common import ROOT, TINY_BASE
from tests.object_store import s3_client, s3_server

pytest.importorskip("s3fs")
pytest.importorskip("moto")

RUN = TINY_BASE + ["train.iters=6", "train.val_interval=3", "train.ckpt_interval=2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as env:
        yield env


@pytest.fixture
def store(server, monkeypatch, tmp_path):
    """The server's environment in this process, a fresh bucket, and caches in tmp_path."""
    for key, value in server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SYNCSEG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SYNCSEG_LEASE_S", "3")
    bucket = f"b{time.monotonic_ns()}"
    s3_client(server).create_bucket(Bucket=bucket)
    return bucket


def keys(env, bucket, prefix=""):
    return sorted(item["Key"] for item in s3_client(env).list_objects_v2(Bucket=bucket, Prefix=prefix)
                  .get("Contents", []))


def stored_iteration(env, bucket, key) -> int:
    body = s3_client(env).get_object(Bucket=bucket, Key=key)["Body"].read()
    return int(torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)["iteration"])


def train(env, output_dir, cache, *extra, stop_at=None, check=True, lease_s=4):
    command = [sys.executable, str(ROOT / "train.py"), "--config", "demo.yaml", f"output_dir={output_dir}", *RUN,
               "--resume", "auto", *extra] + (["--stop-at", str(stop_at)] if stop_at else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cache.parent,
                          env={**os.environ, **env, "SYNCSEG_CACHE_DIR": str(cache), "SYNCSEG_LEASE_S": str(lease_s)})
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_a_run_dir_on_s3_survives_a_kill_during_an_upload_and_resumes_on_another_machine(server, tmp_path):
    """A run on s3:// (staged in machine A's cache) is killed with SIGKILL while last.pt's upload is under way:
    the store keeps the previous last.pt, and machine B (an empty cache) resumes from it, waits out the dead
    run's lease, finishes, and eval.py reads best.pt from the store."""
    bucket = f"kill{time.monotonic_ns()}"
    s3_client(server).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/runs/exp"
    machine_a, machine_b = tmp_path / "a", tmp_path / "b"
    train(server, url, machine_a, stop_at=2)
    assert {"runs/exp/last.pt", "runs/exp/config.yaml", "runs/exp/metrics.jsonl"} <= set(keys(server, bucket))
    assert stored_iteration(server, bucket, "runs/exp/last.pt") == 2

    # part two, on machine A again: killed while last.pt of iteration 4 is being uploaded (a multipart upload:
    # the 137 MB last.pt of the tiny model is larger than s3fs's part size)
    command = [sys.executable, str(ROOT / "train.py"), "--config", "demo.yaml", f"output_dir={url}", *RUN,
               "--resume", "auto", "--stop-at", "6"]
    with (tmp_path / "killed.log").open("w") as log:
        killed = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                  env={**os.environ, **server, "SYNCSEG_CACHE_DIR": str(machine_a),
                                       "SYNCSEG_LEASE_S": "4"})
        client, in_flight = s3_client(server), []
        deadline = time.monotonic() + 240
        while not in_flight and killed.poll() is None and time.monotonic() < deadline:
            uploads = client.list_multipart_uploads(Bucket=bucket, Prefix="runs/exp/.last.pt.").get("Uploads", [])
            in_flight = [upload["Key"] for upload in uploads]
            if not in_flight:
                time.sleep(0.02)
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
    assert in_flight, f"no upload of last.pt was seen: {(tmp_path / 'killed.log').read_text()[-3000:]}"
    assert "saved last.pt at iteration 4" in (tmp_path / "killed.log").read_text()
    assert "runs/exp/last.pt" in keys(server, bucket)
    assert stored_iteration(server, bucket, "runs/exp/last.pt") == 2  # the previous one, whole

    # the killed run's lease as its last renewal left it, dated now: however long machine B takes to start, it
    # finds a lease renewed less than SYNCSEG_LEASE_S=20 s ago, watches it, and takes it over once nobody renews it
    lease = json.loads(client.get_object(Bucket=bucket, Key="runs/exp/.lease")["Body"].read())
    client.put_object(Bucket=bucket, Key="runs/exp/.lease", Body=json.dumps({**lease, "renewed": time.time()}))
    started = time.monotonic()
    done = train(server, url, machine_b, lease_s=20)  # another machine: nothing staged, the store is all it has
    assert "resuming" in done.stderr and "at iteration 2" in done.stderr
    assert f"a lease by {lease['holder']} was renewed" in done.stderr
    assert time.monotonic() - started < 120
    assert stored_iteration(server, bucket, "runs/exp/last.pt") == 6
    stored = keys(server, bucket, "runs/exp/")
    assert not [key for key in stored if key.rsplit("/", 1)[-1].startswith(".")], stored  # no temporaries, no lease
    body = client.get_object(Bucket=bucket, Key="runs/exp/metrics.jsonl")["Body"].read().decode()
    iterations = [json.loads(line)["iteration"] for line in body.splitlines() if json.loads(line)["type"] == "train"]
    assert iterations == [1, 2, 3, 4, 5, 6]  # the killed part's records past iteration 2 are not kept twice

    evaluated = subprocess.run([sys.executable, str(ROOT / "eval.py"), "--checkpoint", f"{url}/best.pt",
                                "--output", str(tmp_path / "eval.json")], capture_output=True, text=True,
                               timeout=300, cwd=tmp_path, env={**os.environ, **server,
                                                               "SYNCSEG_CACHE_DIR": str(tmp_path / "c")})
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["iteration"] == 6


@pytest.mark.slow
def test_storage_that_cannot_be_written_refuses_the_run_at_start_in_one_line(server, tmp_path, monkeypatch):
    """A bucket that does not exist (train.py: exit 2, one line naming the URL and what failed, nothing
    written), credentials the server does not know, an endpoint that does not answer (the same check, in
    this process), each bounded in time."""
    done = train(server, "s3://no-such-bucket/runs/x", tmp_path / "cache", check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert "s3://no-such-bucket/runs/x" in line and "bucket does not exist" in line
    assert not list((tmp_path / "cache").rglob("*.pt"))

    for key, value in server.items():
        monkeypatch.setenv(key, value)
    with s3_server(tmp_path / "auth", authenticate=True) as strict:
        monkeypatch.setenv("AWS_ENDPOINT_URL", strict["AWS_ENDPOINT_URL"])
        with pytest.raises(ValueError, match=r"output_dir 's3://any-bucket/runs/x' cannot be written: access denied"):
            RemoteRunDir("s3://any-bucket/runs/x", tmp_path / "staging").check_writable()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"output_dir 's3://x/runs/x' cannot be written: EndpointConnectionError"):
        RemoteRunDir("s3://x/runs/x", tmp_path / "staging").check_writable()
    assert time.monotonic() - started < 60


def test_a_live_lease_refuses_a_second_run_and_a_released_one_is_taken(store, tmp_path):
    url = f"s3://{store}/runs/busy"
    first = RemoteRunDir(url, tmp_path / "first")
    first.check_writable()
    first.acquire_lease()
    first.start()  # renews the lease every SYNCSEG_LEASE_S / 3
    try:
        second = RemoteRunDir(url, tmp_path / "second")
        started = time.monotonic()
        with pytest.raises(RunDirBusy, match=f"run dir '{url}' is in use by another training"):
            second.acquire_lease()
        assert time.monotonic() - started < 3 + 2
    finally:
        assert first.close()
    second.acquire_lease()  # released at close: taken at once
    assert json.loads(s3_client_from_env().get_object(Bucket=store, Key="runs/busy/.lease")["Body"].read())[
        "owner"] == second.owner
    second.release_lease()
    assert keys(dict(os.environ), store, "runs/busy/") == []


def s3_client_from_env():
    return s3_client(dict(os.environ))


def test_a_leftover_temporary_object_is_never_taken_for_last_pt_and_is_removed(store, tmp_path):
    url = f"s3://{store}/runs/tmp"
    client = s3_client_from_env()
    old = tmp_path / "old.pt"
    torch.save({"iteration": 2}, old)
    client.put_object(Bucket=store, Key="runs/tmp/last.pt", Body=old.read_bytes())
    client.put_object(Bucket=store, Key="runs/tmp/.last.pt.0123456789ab.tmp", Body=b"half a checkpoint")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "best.pt").write_bytes(b"a stale copy the store does not have")
    remote = RemoteRunDir(url, staging)
    assert remote.pull() == ["last.pt"]
    assert torch.load(staging / "last.pt", weights_only=True) == {"iteration": 2}
    assert not (staging / "best.pt").exists()
    assert keys(dict(os.environ), store, "runs/tmp/") == ["runs/tmp/last.pt"]
    assert remote.pull() == []  # the staged copy is the store's: not downloaded again


def test_eval_reads_a_missing_object_as_a_missing_checkpoint(store):
    with pytest.raises(FileNotFoundError, match=f"checkpoint 's3://{store}/nothing/best.pt' not found"):
        local_copy(f"s3://{store}/nothing/best.pt")


def test_a_missing_filesystem_package_names_the_extra():
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ValueError, match=r"pip install 'syncseg\[gcs\]'"):
        object_store.filesystem("gs://bucket/runs/x")


def test_data_root_on_s3_is_mirrored_file_by_file(store, tmp_path):
    """A folder data set's root on the store: mirrored into the cache, read by the folder data set, and on a
    second start only what changed is downloaded."""
    from syncseg.data import build_dataset
    from syncseg.engine.config import load_config
    from syncseg.engine.object_store import local_data

    client = s3_client_from_env()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        image, mask = io.BytesIO(), io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(image, format="PNG")
        Image.fromarray(rng.integers(0, 2, (16, 16), dtype=np.uint8)).save(mask, format="PNG")
        client.put_object(Bucket=store, Key=f"data/leaves/images/{name}.png", Body=image.getvalue())
        client.put_object(Bucket=store, Key=f"data/leaves/masks/{name}.png", Body=mask.getvalue())
    url = f"s3://{store}/data/leaves"
    config = load_config("demo.yaml", ["data.dataset=folder", f"data.root={url}", "data.num_classes=2",
                                       "data.train_split=all", "data.val_split=all"])
    dataset = build_dataset(local_data(config.data), "all", train=False)
    assert len(dataset) == 2
    root = local_data_root(url)
    assert sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file()) == [
        "images/a.png", "images/b.png", "masks/a.png", "masks/b.png"]
    client.put_object(Bucket=store, Key="data/leaves/masks/b.png", Body=(root / "masks/a.png").read_bytes())
    mtimes = {path.name: path.stat().st_mtime_ns for path in (root / "images").iterdir()}
    local_data_root(url)
    assert (root / "masks/b.png").read_bytes() == (root / "masks/a.png").read_bytes()
    assert mtimes == {path.name: path.stat().st_mtime_ns for path in (root / "images").iterdir()}


def test_a_pass_uploads_what_changed_with_the_checkpoints_last(tmp_path, monkeypatch):
    """fsspec's in-memory filesystem: each pass uploads the changed files only, last.pt after everything else,
    every file through a temporary key; the lock and the download stamps stay local."""
    import fsspec

    memory = fsspec.filesystem("memory")
    url = f"memory://run-{time.monotonic_ns()}"
    staging = tmp_path / "staging"
    staging.mkdir()
    for name in ("last.pt", "metrics.jsonl", "config.yaml", ".lock"):
        (staging / name).write_text(name)
    (staging / object_store.SOURCES).mkdir()
    (staging / object_store.SOURCES / "last.pt").write_text("stamp")
    remote = RemoteRunDir(url, staging)
    order = []
    real_put = object_store.put_atomically
    monkeypatch.setattr(remote_run_dir, "put_atomically",
                        lambda fs, local, target: (order.append(Path(local).name), real_put(fs, local, target)))
    assert remote.upload_pass() == 3
    assert order[-1] == "last.pt" and sorted(order) == ["config.yaml", "last.pt", "metrics.jsonl"]
    assert remote.upload_pass() == 0
    time.sleep(0.01)
    (staging / "metrics.jsonl").write_text("metrics.jsonl, longer")
    assert remote.upload_pass() == 1
    assert memory.cat_file(f"{remote.root}/metrics.jsonl") == b"metrics.jsonl, longer"
    assert sorted(path.rsplit("/", 1)[-1] for path in memory.ls(remote.root, detail=False)) == [
        "config.yaml", "last.pt", "metrics.jsonl"]


def test_put_atomically_leaves_the_previous_object_when_the_move_fails(tmp_path):
    import fsspec

    memory = fsspec.filesystem("memory")
    root = f"/atomic-{time.monotonic_ns()}"
    memory.pipe_file(f"{root}/last.pt", b"previous")
    local = tmp_path / "last.pt"
    local.write_bytes(b"new")

    class FailingMove(type(memory)):
        def mv(self, *args, **kwargs):
            raise PermissionError("read-only bucket")

    failing = FailingMove(skip_instance_cache=True)
    with pytest.raises(OSError, match="could not upload .* access denied.*the previous object there"):
        put_atomically(failing, local, f"{root}/last.pt")
    assert memory.cat_file(f"{root}/last.pt") == b"previous"
    assert memory.ls(root, detail=False) == [f"{root}/last.pt"]


def test_uploads_never_block_the_caller_and_close_waits_at_most_its_timeout(tmp_path, monkeypatch):
    """A store that takes its time: request_upload returns at once, and close gives up after timeout_s with a
    warning naming the staging folder."""
    url = f"memory://slow-{time.monotonic_ns()}"
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "last.pt").write_text("x")
    release = threading.Event()
    monkeypatch.setattr(remote_run_dir, "put_atomically", lambda *args: release.wait(20))
    remote = RemoteRunDir(url, staging, timeout_s=0.5)
    remote.start()
    started = time.monotonic()
    remote.request_upload()
    assert time.monotonic() - started < 0.1
    assert not remote.close()
    assert time.monotonic() - started < 5
    release.set()


@pytest.mark.slow
def test_two_ranks_on_two_machines_resume_from_the_store(server, tmp_path):
    """Two DDP ranks with caches of their own (two machines, no shared disk): rank 0 stages and uploads, and on
    resume rank 1, whose cache is new and empty, reads last.pt from the store."""
    from tests.e2e.common import train_forked
    from tests.gloo import free_port, torchrun_environment

    bucket = f"ranks{time.monotonic_ns()}"
    s3_client(server).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/runs/ddp"
    argv = ["--config", "demo.yaml", f"output_dir={url}", *RUN, "data.num_workers=0", "--resume", "auto"]

    def environments(caches):
        return [{**env, **server, "OMP_NUM_THREADS": "1", "SYNCSEG_CACHE_DIR": str(cache), "SYNCSEG_LEASE_S": "4"}
                for env, cache in zip(torchrun_environment(2, free_port()), caches)]

    train_forked(tmp_path / "first", [*argv, "--stop-at", "2"], environments([tmp_path / "a0", tmp_path / "a1"]))
    assert stored_iteration(server, bucket, "runs/ddp/last.pt") == 2
    assert not list((tmp_path / "a1").rglob("*.pt"))  # rank 1 writes nothing
    train_forked(tmp_path / "second", [*argv, "--stop-at", "4"], environments([tmp_path / "a0", tmp_path / "b1"]))
    downloaded = list((tmp_path / "b1" / "downloads").glob("*/last.pt"))  # rank 1's copy of the store's last.pt
    assert len(downloaded) == 1 and torch.load(downloaded[0], weights_only=True)["iteration"] == 2
    assert "resuming" in (tmp_path / "second.rank0.log").read_text()
    assert stored_iteration(server, bucket, "runs/ddp/last.pt") == 4
