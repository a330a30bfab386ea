"""syncseg/engine/cli.py: the one error contract of the command lines (their use of it: tests/e2e/test_cli.py and
each CLI's own tests)."""
from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, Dataset

from syncseg.data import BadSampleError
from syncseg.engine.atomic import write_atomically
from syncseg.engine.cli import (TIME_FORMAT, CommandFailed, describe_os_error, error_line, print_error, run_command,
                        timestamp, unwrap_worker_message, writing)

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"(\d\d:\d\d:\d\d) (\S+): error: (.*)")


def _stderr_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_the_error_line_is_stamped_as_the_logging_lines_are(capsys):
    when = 1_700_000_000.75
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "message", None, None)
    record.created = when
    logged = logging.Formatter("%(asctime)s", datefmt=TIME_FORMAT).format(record)
    assert timestamp(when) == logged and re.fullmatch(r"\d\d:\d\d:\d\d", logged)
    assert error_line("eval.py", "it broke", when=when) == f"{logged} eval.py: error: it broke"
    print_error("train.py", "one line")
    (line,) = _stderr_lines(capsys)
    assert LINE.fullmatch(line).groups()[1:] == ("train.py", "one line")


def _raising(error: BaseException):
    def body() -> int:
        raise error
    return body


@pytest.mark.parametrize("error,code,message", [
    (ValueError("--size '8,8': expected HEIGHT,WIDTH"), 2, "--size '8,8': expected HEIGHT,WIDTH"),
    (FileNotFoundError("checkpoint 'x.pt' not found"), 2, "checkpoint 'x.pt' not found"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.pt"), 2,
     "No such file or directory: '/data/x.pt'"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/out"), 1, "Read-only file system: '/ro/out'"),
    (PermissionError(errno.EACCES, "Permission denied", "/ro/.report.json.k3j2x.tmp"), 1,
     "Permission denied: '/ro'"),  # syncseg.engine.atomic's temporary file is named by its folder
    (OSError(errno.EXDEV, "Invalid cross-device link", "/a/x", None, "/b/x"), 1,
     "Invalid cross-device link: '/a/x' -> '/b/x'"),
    (OSError(errno.ENOSPC, "could not write report 'r.json': No space left on device; the previous file there "
             "(if any) is unchanged"), 1,
     "could not write report 'r.json': No space left on device; the previous file there (if any) is unchanged"),
    (CommandFailed("2 of 5 images could not be read"), 1, "2 of 5 images could not be read"),
])
def test_each_failure_is_one_line_and_its_exit_status(error, code, message, capsys):
    assert run_command("prog.py", _raising(error)) == code
    (line,) = _stderr_lines(capsys)
    assert LINE.fullmatch(line).groups()[1:] == ("prog.py", message)


def test_interrupt_exits_130_and_a_body_s_own_status_passes_through(capsys):
    assert run_command("predict.py", _raising(KeyboardInterrupt())) == 130
    (line,) = _stderr_lines(capsys)
    assert re.fullmatch(r"\d\d:\d\d:\d\d predict\.py: interrupted", line)
    assert run_command("x.py", lambda: 0) == 0 and run_command("x.py", lambda: 1) == 1
    assert capsys.readouterr().err == ""


def test_a_bug_keeps_its_traceback():
    with pytest.raises(RuntimeError, match="a bug"):
        run_command("x.py", _raising(RuntimeError("a bug")))
    with pytest.raises(TypeError):
        run_command("x.py", _raising(TypeError("another")))


def test_describe_skips_names_the_text_already_quotes():
    error = NotADirectoryError(errno.ENOTDIR, "Not a directory", "out/sub")
    assert describe_os_error(error) == "Not a directory: 'out/sub'"
    assert describe_os_error(error, mentioned="could not write masks under 'out/sub'") == "Not a directory"
    assert describe_os_error(OSError("plain message")) == "plain message"


def test_writing_says_what_could_not_be_written_where(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("a regular file, not a folder")
    output = blocker / "sub" / "metrics.json"
    with pytest.raises(NotADirectoryError) as caught:
        with writing("report", output):
            write_atomically(output, lambda file: file.write(b"{}"), what="report")
    assert str(caught.value.strerror) == (f"could not write report '{output}': Not a directory: "
                                          f"'{blocker / 'sub'}'")
    assert caught.value.filename is None  # the message names the files; str(error) is not doubled

    with pytest.raises(FileExistsError) as caught:  # a regular file where a folder must be made
        with writing("report", blocker / "metrics.json"):
            write_atomically(blocker / "metrics.json", lambda file: file.write(b"{}"), what="report")
    assert caught.value.strerror == (f"could not write report '{blocker / 'metrics.json'}': '{blocker}' exists "
                                     "and is not a folder")

    def full(file):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "r.json"
    with pytest.raises(OSError) as caught:  # syncseg.engine.atomic's message already names the file: unchanged
        with writing("report", target):
            write_atomically(target, full, what="report")
    assert caught.value.strerror == (f"could not write report '{target}': No space left on device; the previous "
                                     "file there (if any) is unchanged")
    with pytest.raises(OSError) as caught:  # a bare OS reason gets the path
        with writing("statistics", target):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.strerror == f"could not write statistics '{target}': No space left on device"
    with pytest.raises(ValueError):  # not an OSError: untouched
        with writing("report", target):
            raise ValueError("bad")


def test_a_read_only_folder_names_the_file_and_the_reason(read_only_dir, capsys):
    output = read_only_dir / "metrics.json"

    def body() -> int:
        with writing("report", output):
            write_atomically(output, lambda file: file.write(b"{}"), what="report")
        return 0

    assert run_command("eval.py", body) == 1
    (line,) = _stderr_lines(capsys)
    assert LINE.fullmatch(line).group(3) == (f"could not write report '{output}': Read-only file system: "
                                             f"'{read_only_dir}'")


def test_importing_it_imports_no_third_party_package():
    code = "import sys, syncseg.engine.cli; print(sorted(m for m in ('torch', 'numpy', 'yaml') if m in sys.modules))"
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == "[]"


class _BadMask(Dataset):
    """Sample 1 is bad, as syncseg.data.base.SegmentationDataset raises it in a DataLoader worker."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        if index == 1:
            raise BadSampleError("mask '/data/masks/b.png' has values [7] outside [0, 2]")
        return index


def test_a_bad_sample_in_a_dataloader_worker_is_still_one_line_naming_the_file(capsys):
    with pytest.raises(BadSampleError) as caught:
        list(DataLoader(_BadMask(), batch_size=None, num_workers=1))
    error = caught.value
    assert "DataLoader worker process" in str(error) and "Traceback" in str(error)  # what torch re-raises

    def body() -> int:
        raise error

    assert run_command("train.py", body) == 2
    (line,) = _stderr_lines(capsys)
    assert LINE.fullmatch(line).group(3) == "mask '/data/masks/b.png' has values [7] outside [0, 2]"


@pytest.mark.parametrize("message", [
    "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    "  File \"x.py\", line 1, in <module>\nValueError: a: b\n",
    "Caught FileNotFoundError in DataLoader worker process 3.\nOriginal Traceback (most recent call last):\n"
    "  File \"x.py\", line 1\nFileNotFoundError: a: b",
])
def test_worker_messages_unwrap_to_the_original_and_others_stay(message):
    assert unwrap_worker_message(message) == "a: b"
    assert unwrap_worker_message("a: b") == "a: b"
    assert unwrap_worker_message("Caught ValueError in DataLoader worker process 0.\nno traceback") == (
        "Caught ValueError in DataLoader worker process 0.\nno traceback")
