"""A run dir on object storage (output_dir=s3://bucket/runs/x): staged on local disk, uploaded behind training.

Training writes into a local staging folder (cache_root()/runs/<url's name>; Config.run_dir) exactly as it
writes a local run dir: the same atomic saves, lock and files. Rank 0 mirrors that folder to the URL from a
thread of its own: after each checkpoint save a pass uploads every file that changed, last.pt and best.pt
after the rest (so metrics.jsonl never lags the checkpoint a resume reads), each through a temporary key
and a move (object_store.put_atomically), the bytes sent by a low-priority process of its own
(syncseg.engine.upload_worker: in a thread, the client's work took the GIL from the training). Saves that
come faster than uploads coalesce into one pass: a step never waits for the store. At the end (and on a stop) the last pass is waited for, at most
log.timeout_s; what it could not upload stays in the staging folder, and the warning says where.

Starting: the URL is probed with a small write (a missing bucket or bad credentials refuse the run at
start, one line), then leased, then its last.pt, best.pt, metrics.jsonl and config.yaml replace the
staging folder's: the store is the truth, so `--resume auto` on another machine, or after the pod's disk
is gone, resumes the last complete last.pt uploaded.

The lease (object `.lease` in the run dir) stands in for flock, which object stores lack. Its holder
rewrites it every LEASE_S / 3 seconds. A run that finds a lease someone else renewed within LEASE_S
watches it for LEASE_S (SYNCSEG_LEASE_S, default 60) and takes it over only if nobody renewed it meanwhile:
a killed run's lease lapses, a live one refuses the second run. Two runs started within the same second
can both win (the store has no compare-and-swap that every S3-compatible server offers); the lease guards
against a second run in the same folder, not against that race.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from syncseg.engine.object_store import (SOURCES, describe_error, download, filesystem, is_temporary, join,
                                         put_atomically, stamp_of)

logger = logging.getLogger(__name__)

LEASE_NAME = ".lease"
PULLED = ("config.yaml", "metrics.jsonl", "best.pt", "last.pt")  # what a resume needs from the store
IN_PROCESS = ("memory", "file", "local")  # filesystems uploaded to in this process (no network, no GIL-heavy client)
LAST = ("best.pt", "last.pt")  # uploaded after every other file of a pass
SKIPPED = (".lock", SOURCES)  # the staging folder's own bookkeeping (a file's or a folder's name)


def lease_seconds() -> float:
    return float(os.environ.get("SYNCSEG_LEASE_S") or 60)


class RunDirBusy(ValueError):
    """Another live run holds the lease."""


class RemoteRunDir:
    """The store side of one run dir: `url` on the store, `staging` on local disk."""

    def __init__(self, url: str, staging: Path, *, timeout_s: float = 30.0) -> None:
        self.url, self.staging, self.timeout_s = url.rstrip("/"), Path(staging), timeout_s
        self.fs, self.root = filesystem(self.url)
        self.owner = uuid.uuid4().hex
        self._uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) last uploaded
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._worker: subprocess.Popen | None = None  # the upload process, started by the uploader thread
        self.failure: str | None = None

    def _remote(self, relative: str) -> str:
        return join(self.root, relative)

    # -- start ---------------------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """ValueError naming the URL when a small object cannot be written and removed there."""
        probe = self._remote(f".syncseg-probe-{self.owner[:8]}")
        try:
            self.fs.pipe_file(probe, b"syncseg write check\n")
            self.fs.rm_file(probe)
        except Exception as error:
            raise ValueError(f"output_dir '{self.url}' cannot be written: {describe_error(error)}; fix it or set "
                             "output_dir= to another place") from None

    def _read_lease(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self._remote(LEASE_NAME)))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            return {"owner": "unreadable", "holder": "unreadable lease", "renewed": 0.0}

    def _write_lease(self) -> None:
        self.fs.invalidate_cache()
        record = {"owner": self.owner, "holder": f"host {socket.gethostname()}, pid {os.getpid()}",
                  "renewed": time.time()}
        self.fs.pipe_file(self._remote(LEASE_NAME), json.dumps(record).encode())

    def acquire_lease(self) -> None:
        """Take the run dir's lease, waiting out one that nobody renews; RunDirBusy when another run renews it."""
        lease_s = lease_seconds()
        found = self._read_lease()
        if found and time.time() - float(found.get("renewed", 0)) < lease_s:
            logger.warning("output_dir %s: a lease by %s was renewed %.0f s ago; waiting up to %.0f s to see whether "
                           "that run is alive (SYNCSEG_LEASE_S)", self.url, found.get("holder"),
                           time.time() - float(found.get("renewed", 0)), lease_s)
            deadline = time.monotonic() + lease_s
            while time.monotonic() < deadline:
                time.sleep(min(2.0, lease_s / 10))
                self.fs.invalidate_cache()
                now = self._read_lease()
                if now and now.get("renewed") != found.get("renewed"):
                    raise RunDirBusy(f"run dir '{self.url}' is in use by another training ({now.get('holder')}, lease "
                                     "renewed just now); wait for it to finish, stop it, or set output_dir= to "
                                     "another place")
                if now is None:
                    break
        self._write_lease()
        time.sleep(min(1.0, lease_s / 10))  # a run that started at the same moment has written by now
        self.fs.invalidate_cache()
        now = self._read_lease()
        if not now or now.get("owner") != self.owner:
            raise RunDirBusy(f"run dir '{self.url}' was taken by another training at the same moment "
                             f"({(now or {}).get('holder', 'unknown')}); set output_dir= to another place")

    def pull(self) -> list[str]:
        """Replace the staging folder's resume files by the store's (removing local ones the store lacks) and
        delete temporary objects of killed uploads; the names downloaded."""
        self.staging.mkdir(parents=True, exist_ok=True)
        self.fs.invalidate_cache()
        try:
            listed = {info["name"].rsplit("/", 1)[-1]: info for info in self.fs.ls(self.root, detail=True)}
        except FileNotFoundError:
            listed = {}
        for name, info in listed.items():
            if is_temporary(name):
                self.fs.rm_file(info["name"])
                logger.warning("removed %s, the temporary object of an interrupted upload", join(self.url, name))
        pulled = []
        for name in PULLED:
            local = self.staging / name
            if name in listed:
                if download(self.fs, listed[name]["name"], local, stamp_file=self.staging / SOURCES / name,
                            info=listed[name]):
                    pulled.append(name)
                self._remember(name)
            elif local.exists():
                local.unlink()  # never uploaded: the store holds the run, a stale staging copy is not it
                logger.warning("removed %s: %s has no %s", local, self.url, name)
        if pulled:
            logger.info("output_dir %s: downloaded %s to %s", self.url, ", ".join(pulled), self.staging)
        return pulled

    # -- uploads -------------------------------------------------------------------------------------------
    def _remember(self, relative: str) -> None:
        status = (self.staging / relative).stat()
        self._uploaded[relative] = (status.st_size, status.st_mtime_ns)

    def _changed(self) -> list[str]:
        found = []
        for path in sorted(self.staging.rglob("*")):
            relative = path.relative_to(self.staging)
            if not path.is_file() or SKIPPED[0] == path.name or SOURCES in relative.parts or is_temporary(path.name):
                continue
            relative = relative.as_posix()
            status = path.stat()
            if self._uploaded.get(relative) != (status.st_size, status.st_mtime_ns):
                found.append(relative)
        return sorted(found, key=lambda relative: (relative in LAST, LAST.index(relative) if relative in LAST else 0,
                                                   relative))

    def upload_pass(self) -> int:
        """Upload every file changed since the last pass (last.pt last); the number uploaded."""
        changed = self._changed()
        for relative in changed:
            local = self.staging / relative
            status = local.stat()
            self._put(local, self._remote(relative))
            self._uploaded[relative] = (status.st_size, status.st_mtime_ns)
            if relative in PULLED:  # a resume on this machine then knows its copy is the store's
                self.fs.invalidate_cache()
                stamp = self.staging / SOURCES / relative
                stamp.parent.mkdir(parents=True, exist_ok=True)
                stamp.write_text(stamp_of(self.fs.info(self._remote(relative))))
        return len(changed)

    def _put(self, local: Path, remote: str) -> None:
        """put_atomically, in the upload process (syncseg.engine.upload_worker) for a store over the network."""
        if self.url.split("://", 1)[0] in IN_PROCESS:
            put_atomically(self.fs, local, remote)
            return
        if self._worker is None or self._worker.poll() is not None:
            package_root = str(Path(__file__).resolve().parents[2])  # where `syncseg` imports from, for the child
            path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
            # started by this (the uploader) thread: the process dies with it (PR_SET_PDEATHSIG)
            self._worker = subprocess.Popen([sys.executable, "-m", "syncseg.engine.upload_worker", self.url],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                            env={**os.environ, "PYTHONPATH": path})
        answer, failure = "", ""
        try:
            self._worker.stdin.write(json.dumps({"local": str(local), "remote": remote}) + "\n")
            self._worker.stdin.flush()
            answer = self._worker.stdout.readline()
        except OSError as error:
            failure = f": {error}"
        if not answer:
            raise OSError(f"the upload process ended (exit code {self._worker.poll()}) while uploading '{local}'"
                          f"{failure}")
        error_line = json.loads(answer)["error"]
        if error_line:
            raise OSError(error_line)

    def _stop_worker(self) -> None:
        if self._worker is not None:
            with contextlib.suppress(OSError):
                self._worker.stdin.close()
            try:
                self._worker.wait(10)
            except subprocess.TimeoutExpired:
                self._worker.kill()
                self._worker.wait()
            self._worker = None

    def start(self) -> None:
        """Start the uploader (it also renews the lease)."""
        self._thread = threading.Thread(target=self._work, name="syncseg-run-dir-upload", daemon=True)
        self._thread.start()

    def request_upload(self) -> None:
        """Ask for a pass soon; never blocks."""
        self._idle.clear()
        self._wake.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every requested pass has run (at most timeout_s); False when one is still running."""
        return self._idle.wait(timeout_s)

    def _work(self) -> None:
        renew_every = lease_seconds() / 3
        renewed = time.monotonic()
        while True:
            woken = self._wake.wait(timeout=renew_every)
            self._wake.clear()
            try:
                if time.monotonic() - renewed >= renew_every or self._closing:
                    self._write_lease()
                    renewed = time.monotonic()
                if woken:
                    self.upload_pass()
            except Exception as error:  # the next pass retries; the warning says it once per kind of failure
                message = str(error) if isinstance(error, OSError) else describe_error(error)
                if message != self.failure:
                    logger.warning("output_dir %s: %s; the files stay in %s and the next save retries", self.url,
                                   message, self.staging)
                self.failure = message
            else:
                if woken:
                    self.failure = None
            if not self._wake.is_set():
                self._idle.set()
            if self._closing and not self._wake.is_set():
                self._stop_worker()
                return

    def close(self, *, release: bool = True) -> bool:
        """A last pass, waited for at most timeout_s, then the lease released; False when files were left
        behind (named in a warning)."""
        if self._thread is None:
            if release:
                self.release_lease()
            return True
        self._closing = True
        self.request_upload()
        self._thread.join(self.timeout_s)
        complete = not self._thread.is_alive() and self.failure is None
        if self._thread.is_alive():
            logger.warning("output_dir %s: the last upload did not finish within log.timeout_s=%g s; the newest "
                           "files are in %s only", self.url, self.timeout_s, self.staging)
        elif release:
            self.release_lease()
        self._thread = None
        return complete

    def release_lease(self) -> None:
        """Delete the lease when it is still ours (a run ending, or refused after taking it)."""
        try:
            self.fs.invalidate_cache()
            if (self._read_lease() or {}).get("owner") == self.owner:
                self.fs.rm_file(self._remote(LEASE_NAME))
        except Exception as error:
            logger.warning("output_dir %s: could not release the lease: %s", self.url, describe_error(error))

    def remove(self, name: str) -> None:
        """Delete the run dir's object `name` (--overwrite), if there is one."""
        try:
            self.fs.rm_file(self._remote(name))
        except FileNotFoundError:
            return
        self._uploaded.pop(name, None)
        logger.warning("--overwrite: deleted %s", join(self.url, name))
