"""Files written atomically: a temporary file in the same folder, fsync, os.replace, so a file is either
its old content or the complete new one, never half-written (a full disk, a kill, a power cut).

Checkpoints, safetensors and exports, config.yaml, the resume's trim of metrics.jsonl, eval reports
and prediction PNGs all go through `write_atomically`. A failed write is an OSError naming what and
where, also when the serializer hid it: torch's zip writer swallows the OSError of a failed write and
raises "[enforce fail at inline_container.cc] unexpected pos ..." instead.
"""
from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMPORARY_SUFFIX = ".tmp"  # write_atomically writes .<name>.<random>.tmp beside <name>, then renames it


def current_umask() -> int:
    """The process umask, read without changing it where Linux reports it (/proc/self/status), else by
    setting and restoring it (a brief window in which another thread's new file could get mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _WriteErrorRecorder(io.BufferedIOBase):
    """The file object a serializer writes through, keeping the first OSError a write raised. An
    io.BufferedIOBase that can seek, as torch.export.save requires of a buffer; closing it leaves the
    file open."""

    def __init__(self, file: Any) -> None:
        super().__init__()
        self._file = file
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as error:
            if self.error is None:
                self.error = error
            raise

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def seekable(self) -> bool:
        return self._file.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()


def write_atomically(path: str | Path, write: Callable[[Any], None], *, what: str = "checkpoint",
                     durable: bool = True) -> None:
    """Create `path` through `write(file)`, atomically: `write` fills a temporary file in the same folder
    (a seekable binary file object), which is fsynced and renamed over `path`, so `path` is
    either its old content or the complete new one. The file gets mode 0666 & ~umask like any file the
    user creates (mkstemp's own 0600 would hide it from teammates). Creates the parent folder.
    `durable=False` skips the fsyncs (outputs written by the thousand, such as prediction images: still
    never half-written, but a power cut may lose them).

    Any failure removes the temporary file. An OSError (a full disk, a quota, a read-only folder) becomes
    one naming `what` and `path` and saying the previous file is unchanged, also when the serializer hid
    it: torch's zip writer swallows the OSError of a failed write and raises "[enforce fail at
    inline_container.cc] unexpected pos ..." instead.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX)
    try:
        os.fchmod(handle, 0o666 & ~current_umask())
        with os.fdopen(handle, "wb") as file:
            writer = _WriteErrorRecorder(file)
            try:
                write(writer)
            except Exception as error:
                if writer.error is None or isinstance(error, OSError):
                    raise
                raise writer.error from error
            file.flush()
            if durable:
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        if isinstance(error, OSError) and error.errno is not None:  # not io.UnsupportedOperation, a bug
            raise OSError(error.errno, f"could not write {what} '{path}': {error.strerror or error}; "
                          "the previous file there (if any) is unchanged") from None
        raise
    if not durable:
        return
    try:  # make the rename itself durable; not possible on every platform / filesystem
        directory = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(directory)
    except OSError:
        pass
    finally:
        os.close(directory)
