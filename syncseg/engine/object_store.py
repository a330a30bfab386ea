"""Object storage through fsspec: run dirs, checkpoints and data roots given as URLs (s3://, gs://, ...).

Nothing here opens a connection unless a URL is given. A URL's filesystem comes from fsspec's registry, so
s3:// needs s3fs and gs:// needs gcsfs (`pip install 'syncseg[s3]'` / `'syncseg[gcs]'`); credentials and
endpoints are the ones the filesystem reads itself (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL, AWS_PROFILE, ...). S3 requests are bounded in time (STORE_TIMEOUT_S to connect, a few
retries), so a store that does not answer is an error, not a hang.

An object becomes visible only complete: `put_atomically` uploads to a temporary key beside the target
(`.<name>.<random>.tmp`) and then moves it into place, so a reader (a resume on another machine) sees the
previous object or the whole new one, never a part of one, also when the uploader is killed.

Reading: `local_copy(url)` downloads an object into the user's cache (atomically, reused while its size and
modification time match) and returns the local path: eval.py and predict.py on s3://.../best.pt, `--resume
s3://.../last.pt`. `local_data_root(url)` mirrors a folder data set's root the same way, file by file.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any

from syncseg.engine.atomic import TEMPORARY_SUFFIX, write_atomically

logger = logging.getLogger(__name__)

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # protocol -> pip extra of syncseg
SOURCES = ".syncseg-sources"  # where download() remembers which version of each object a local file is
STORE_TIMEOUT_S = 20  # to connect, and to read one answer, per S3 request
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def is_url(value: Any) -> bool:
    """True for an fsspec URL other than a local file (s3://bucket/key, gs://..., memory://...)."""
    text = str(value)
    return "://" in text and not text.startswith("file://")


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def cache_root() -> Path:
    """Where downloads and staged run dirs live: $SYNCSEG_CACHE_DIR, else ~/.cache/syncseg (XDG_CACHE_HOME)."""
    if os.environ.get("SYNCSEG_CACHE_DIR"):
        return Path(os.environ["SYNCSEG_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "syncseg"


def local_name(url: str) -> str:
    """A folder name for `url`: readable, and unique by a hash of the whole URL."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', url.split('://', 1)[-1].rstrip('/'))[-80:]}-{digest}"


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for `url`. ValueError naming the pip extra when the
    filesystem's package is not installed."""
    import fsspec
    from fsspec.core import url_to_fs

    protocol = url.split("://", 1)[0]
    options: dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        options["config_kwargs"] = {"connect_timeout": STORE_TIMEOUT_S, "read_timeout": STORE_TIMEOUT_S,
                                    "retries": {"max_attempts": 3, "mode": "standard"}}
    try:
        # not fsspec's shared instance: the credentials and endpoint are read now, from this environment
        return url_to_fs(url, skip_instance_cache=True, **options)
    except ImportError as error:
        extra = EXTRAS.get(protocol)
        hint = f"pip install 'syncseg[{extra}]'" if extra else "install the fsspec filesystem for it"
        raise ValueError(f"'{url}' needs the package for {protocol}:// ({error}); {hint}") from None
    except ValueError as error:
        known = ", ".join(sorted(fsspec.available_protocols())[:12])
        raise ValueError(f"'{url}': {error} (fsspec knows {known}, ...)") from None


def describe_error(error: BaseException) -> str:
    """What a store's error means, in one line."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, FileNotFoundError) and "bucket" in text.lower():
        return f"the bucket does not exist ({text})"
    if isinstance(error, PermissionError):
        return f"access denied: check the credentials and the bucket's permissions ({text})"
    return f"{type(error).__name__}: {text}"


def put_atomically(fs: Any, local: Path, remote: str) -> None:
    """Upload `local` to `remote` through a temporary key and a move: `remote` is the old object or the
    complete new one. Raises OSError naming both."""
    folder, name = remote.rsplit("/", 1)
    temporary = f"{folder}/.{name}.{uuid.uuid4().hex[:12]}{TEMPORARY_SUFFIX}"
    try:
        fs.put_file(str(local), temporary)
        fs.mv(temporary, remote)
    except Exception as error:
        try:
            fs.rm_file(temporary)
        except Exception:
            pass
        raise OSError(f"could not upload '{local}' to '{fs.unstrip_protocol(remote)}': "
                      f"{describe_error(error)}; the previous object there (if any) is unchanged") from None


def is_temporary(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMPORARY_SUFFIX)


def stamp_of(info: dict[str, Any]) -> str:
    """What tells two versions of an object apart: size plus ETag or modification time."""
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return f"{info.get('size')}:{version}"


def download(fs: Any, remote: str, local: Path, *, stamp_file: Path, info: dict[str, Any] | None = None) -> bool:
    """Copy `remote` to `local` atomically unless `local` is already that version (`stamp_file`, kept outside
    the folder the data set or the run reads, remembers which); True when it downloaded."""
    info = info or fs.info(remote)
    stamp = stamp_of(info)
    if local.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return False

    def copy(file: Any) -> None:
        with fs.open(remote, "rb", block_size=8 << 20) as source:
            while chunk := source.read(8 << 20):
                file.write(chunk)

    write_atomically(local, copy, what=f"the download of {fs.unstrip_protocol(remote)}")
    stamp_file.parent.mkdir(parents=True, exist_ok=True)
    stamp_file.write_text(stamp)
    return True


def local_copy(url: str | Path) -> Path:
    """A local path holding the object at `url` (itself when it is not a URL): downloaded into
    cache_root()/downloads, reused while the object is unchanged. FileNotFoundError when there is none."""
    if not is_url(url):
        return Path(url)
    url = str(url)
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint '{url}' not found (expected a .pt file written by train.py)") from None
    except Exception as error:
        raise ValueError(f"'{url}' could not be read: {describe_error(error)}") from None
    if info.get("type") == "directory":
        raise FileNotFoundError(f"'{url}' is a folder, expected a file such as {join(url, 'best.pt')}")
    folder = cache_root() / "downloads" / local_name(url)
    local = folder / path.rsplit("/", 1)[-1]
    if download(fs, path, local, stamp_file=folder / SOURCES / local.name, info=info):
        logger.info("downloaded %s to %s", url, local)
    return local


def local_data_root(url: str) -> Path:
    """A local mirror of the folder at `url` (every file below it) in cache_root()/data, updated file by file
    where the store's copy changed; the local root itself when `url` is not a URL."""
    if not is_url(url):
        return Path(url)
    fs, root = filesystem(url)
    try:
        found = fs.find(root, detail=True)
    except Exception as error:
        raise ValueError(f"data.root '{url}' could not be listed: {describe_error(error)}") from None
    if not found:
        raise FileNotFoundError(f"data.root '{url}' holds no files (expected the data set's folders there)")
    local_root = cache_root() / "data" / local_name(url)
    stamps = cache_root() / "data" / SOURCES / local_name(url)
    prefix = root.rstrip("/") + "/"
    fetched = 0
    for remote, info in sorted(found.items()):
        relative = remote[len(prefix):] if remote.startswith(prefix) else remote.rsplit("/", 1)[-1]
        if info.get("type") == "directory" or is_temporary(relative.rsplit("/", 1)[-1]):
            continue
        fetched += download(fs, remote, local_root / relative, stamp_file=stamps / relative, info=info)
    logger.info("data.root %s: %d files in %s (%d downloaded now)", url, len(found), local_root, fetched)
    return local_root


def local_data(data_cfg: Any) -> Any:
    """`data_cfg` (a DataConfig) with a data.root URL replaced by its local mirror (local_data_root)."""
    if not is_url(getattr(data_cfg, "root", "")):
        return data_cfg
    import dataclasses

    return dataclasses.replace(data_cfg, root=str(local_data_root(data_cfg.root)))
