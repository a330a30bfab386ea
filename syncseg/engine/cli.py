"""The error contract of every command line (train.py, eval.py, `python -m syncseg predict`, `python -m syncseg export`,
`python -m syncseg verify`, `python -m syncseg prepare-voc`): what a failure prints and the status it exits with, stated once here.

Exit statuses:

    0    done.
    1    the command ran but failed: the system refused a file (a full disk, a read-only or missing
         folder, a path under a regular file, no permission: the line names the file and the OS's
         reason), or the result is bad (CommandFailed: an export that does not match PyTorch, images
         predict.py had to skip, samples verify_dataset.py found broken; train.py: a non-finite loss, a
         peer process lost).
    2    the command cannot run as given: a bad command line, config, dataset, input or checkpoint
         (ValueError, FileNotFoundError). argparse's own usage errors exit 2 too.
    130  interrupted (Ctrl-C). train.py exits 128 + the signal number (130 SIGINT, 143 SIGTERM) after a
         signal stopped it and last.pt was saved.

Every failure is ONE line on stderr, `HH:MM:SS <prog>: error: <message>` (`HH:MM:SS <prog>: interrupted`),
stamped like the logging lines (logging.basicConfig(datefmt=TIME_FORMAT)), so a log shows how long after
the last progress line the fault came. Anything else (a RuntimeError, a bug) keeps its traceback. An
error raised in a DataLoader worker (a bad sample with data.num_workers > 0) reaches the main process as
the same type with the worker's traceback in its message; the line is the original message alone.

This module imports the standard library only: the CLIs import it before torch, so that --help and
argument errors stay instant.
"""
from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncseg.engine.atomic import TEMPORARY_SUFFIX  # standard library only, like this module

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C
TIME_FORMAT = "%H:%M:%S"  # the datefmt of every CLI's logging.basicConfig, and of the error lines


class CommandFailed(Exception):
    """The command ran but its result is bad (exit 1); the message is the one line to print."""


def timestamp(when: float | None = None) -> str:
    """`when` (seconds since the epoch; default now) as the logging lines print their time: local
    time in TIME_FORMAT, as logging.Formatter(datefmt=TIME_FORMAT) formats a record's `created`."""
    return time.strftime(TIME_FORMAT, time.localtime(when))


def error_line(prog: str, message: str, *, when: float | None = None) -> str:
    """`HH:MM:SS <prog>: error: <message>`, stamped with timestamp(when)."""
    return f"{timestamp(when)} {prog}: error: {message}"


def print_error(prog: str, message: str) -> None:
    """Write error_line(prog, message) to stderr: the one way a CLI reports a failure."""
    print(error_line(prog, message), file=sys.stderr, flush=True)


def _file_name(name: Any) -> str:
    return os.fsdecode(name) if isinstance(name, (str, bytes, os.PathLike)) else str(name)


def describe_os_error(error: OSError, *, mentioned: str = "") -> str:
    """The OS's reason and the file(s) it concerns, e.g. "Read-only file system: '/data/out'".

    Names OSError.filename and .filename2 (as str(error) does, without its "[Errno N]") unless the
    reason or `mentioned` (the text this will follow) already quotes them. A temporary file of
    syncseg.engine.atomic (`.<name>.<random>.tmp`, which the user never asked for) is named by its folder.
    An OSError raised with a message only (FileNotFoundError("checkpoint 'x' not found")) is that message.
    """
    reason = error.strerror or str(error)
    said = mentioned + reason
    names: list[str] = []
    for raw in (error.filename, error.filename2):
        if raw is None:
            continue
        name = _file_name(raw)
        base = os.path.basename(name)
        if base.startswith(".") and base.endswith(TEMPORARY_SUFFIX):
            name = os.path.dirname(name) or "."
        if f"'{name}'" not in said and name not in names:
            names.append(name)
    return reason + (": " + " -> ".join(f"'{name}'" for name in names) if names else "")


# torch.utils.data's ExceptionWrapper.reraise: "Caught <type> in DataLoader worker process <n>.\nOriginal
# Traceback (most recent call last):\n ... <module>.<type>: <the original message>"
_WORKER_ERROR = re.compile(r"Caught (\w+) in DataLoader worker process \d+\.\nOriginal Traceback")


def unwrap_worker_message(message: str) -> str:
    """The original message of an error re-raised from a DataLoader worker (the last line of the worker's
    traceback that starts with its type, and anything after it); `message` itself otherwise."""
    match = _WORKER_ERROR.match(message)
    if match is None:
        return message
    lines = message.rstrip("\n").split("\n")
    for index in range(len(lines) - 1, 0, -1):
        head, separator, rest = lines[index].partition(": ")
        if separator and (head == match.group(1) or head.endswith("." + match.group(1))):
            return "\n".join([rest, *lines[index + 1:]])
    return message


def describe_error(error: BaseException) -> str:
    """The message of an error line: describe_os_error for an OSError (without str()'s "[Errno N]"),
    else str(error); an error from a DataLoader worker gives its original message."""
    return unwrap_worker_message(describe_os_error(error) if isinstance(error, OSError) else str(error))


RUNTIMES = ("torch", "onnxruntime", "openvino")  # --runtime (syncseg.engine.runtimes runs the last two)


def add_runtime_arguments(parser: Any) -> None:
    """--runtime, --exported and --threads of eval.py and predict.py (syncseg.engine.runtimes)."""
    parser.add_argument("--runtime", choices=RUNTIMES, default="torch",
                        help="what runs the network: torch (PyTorch eager, the default), onnxruntime or openvino "
                             "(an ONNX export of the checkpoint, written once into .syncseg-exports/ beside it "
                             "unless --exported names one; CPU only)")
    parser.add_argument("--exported", metavar="ONNX",
                        help="with --runtime onnxruntime/openvino: this export of the checkpoint (e.g. the "
                             "best.int8.onnx of `python -m syncseg export --format onnx --int8`)")
    parser.add_argument("--threads", type=int, default=0,
                        help="with --runtime onnxruntime/openvino: the runtime's thread count (default 0: its "
                             "own choice, one per physical core)")


@dataclass
class RuntimeChoice:
    """What load_inference_model is asked to run the network in (syncseg.engine.runtimes.runtime_model)."""

    runtime: str = "torch"
    exported: Path | None = None  # an ONNX file of this checkpoint; None: the cache's
    threads: int = 0  # 0: the runtime's own choice


def runtime_choice(args: Any) -> RuntimeChoice | None:
    """The RuntimeChoice of parsed --runtime/--exported/--threads (None for torch); ValueError for
    --exported or --threads without a runtime that uses them."""
    if args.runtime == "torch":
        if args.exported is not None or args.threads:
            raise ValueError("--exported and --threads apply to --runtime onnxruntime or openvino, not torch")
        return None
    return RuntimeChoice(args.runtime, Path(args.exported) if args.exported else None, args.threads)


@contextmanager
def writing(what: str, path: Any) -> Iterator[None]:
    """Let an OSError raised inside say what could not be written where: it becomes
    "could not write <what> '<path>': <reason>: '<file>'" (the same type, by its errno).

    An error that already names `path` is left as it is: syncseg.engine.atomic.write_atomically's say
    "could not write <what> '<file>': <reason>; the previous file there (if any) is unchanged".
    """
    try:
        yield
    except OSError as error:
        if error.errno is None:  # io.UnsupportedOperation and the like: a bug, not the disk
            raise
        if error.filename is None and error.filename2 is None and f"'{path}" in (error.strerror or str(error)):
            raise  # already names `path` or a file under it (syncseg.engine.atomic quotes the file it writes)
        start = f"could not write {what} '{path}'"
        if isinstance(error, FileExistsError) and error.filename is not None and not os.path.isdir(error.filename):
            # mkdir(exist_ok=True) on a file: "File exists" alone reads as if the output were the problem
            detail = f"'{_file_name(error.filename)}' exists and is not a folder"
        else:
            detail = describe_os_error(error, mentioned=start)
        raise OSError(error.errno, f"{start}: {detail}") from error


def run_command(prog: str, body: Callable[[], int], *,
                reports_usage_errors: Callable[[], bool] = lambda: True) -> int:
    """Run a CLI's `body` (returning its exit status) under the contract of this module's docstring:
    ValueError / FileNotFoundError -> one error line, 2; other OSError -> one line naming the file and
    the reason, 1; CommandFailed -> its line, 1; KeyboardInterrupt -> "<prog>: interrupted" (and its
    message, if it has one), 130. Other exceptions propagate with their traceback. Returns the exit status
    for sys.exit.

    `reports_usage_errors()` False keeps a status-2 error silent: the processes of a distributed run
    other than rank 0 meet the same bad input, and one line is enough.
    """
    try:
        return body()
    except (ValueError, FileNotFoundError) as error:  # FileNotFoundError before OSError: it is one
        if reports_usage_errors():
            print_error(prog, describe_error(error))
        return EXIT_USAGE
    except (OSError, CommandFailed) as error:
        print_error(prog, describe_error(error))
        return EXIT_FAILED
    except KeyboardInterrupt as interrupt:
        detail = f" {interrupt}" if str(interrupt) else ""
        print(f"{timestamp()} {prog}: interrupted{detail}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
