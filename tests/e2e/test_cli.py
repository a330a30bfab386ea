"""Every command line: --help answers at once (lazy imports) and harmlessly, every flag has a help text,
and --print-config shows the resolved config."""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PYTHON_CLIS = ["train.py", "eval.py"]
# python -m syncseg <command> (syncseg/__main__.py)
SYNCSEG_COMMANDS = ["train", "eval", "predict", "export", "verify", "prepare-voc"]
MODULES = ["syncseg.commands.train", "syncseg.commands.eval", "syncseg.commands.predict", "syncseg.commands.export", "syncseg.commands.verify_dataset", "syncseg.commands.prepare_voc"]
BENCHMARKS = ["benchmarks.bench_syncbn", "benchmarks.bench_model", "benchmarks.bench_data", "benchmarks.bench_eval",
              "benchmarks.bench_train", "benchmarks.bench_cuda", "benchmarks.bench_host_syncs",
              "benchmarks.bench_runtimes"]
HELP_CPU_SECONDS = 2.0


def _child_cpu_seconds(command: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run `command` and return it with the CPU time (user + system) the child used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return process, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize("command", [[sys.executable, path] for path in PYTHON_CLIS]
                         + [[sys.executable, "-m", "syncseg", name] for name in SYNCSEG_COMMANDS]
                         + [[sys.executable, "-m", "syncseg"], [sys.executable, "-m", "syncseg.commands.predict"],
                            ["bash", "scripts/gpu_check.sh"]], ids=lambda command: " ".join(command[1:]))
def test_help_is_fast_and_exits_zero(command):
    process, seconds = _child_cpu_seconds([*command, "--help"])
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.lower().startswith("usage:")
    assert seconds < HELP_CPU_SECONDS, f"{' '.join(command)} --help took {seconds:.2f} s of CPU time"


def test_gpu_check_help_runs_nothing(tmp_path):
    for args in (["--help"], ["-h"], ["--bogus"], []):
        process = subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=30)
        assert process.returncode == (0 if args in (["--help"], ["-h"]) else 2), (args, process.stderr)
        assert "usage: scripts/gpu_check.sh OUTPUT_DIR" in process.stdout + process.stderr
        assert "CUDA test files" not in process.stdout + process.stderr  # the check itself never started
    assert not (ROOT / "--help").exists() and not (ROOT / "--bogus").exists()


def _parser_of(module_name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser a CLI's main() builds, caught when it prints --help."""
    caught = []

    def capture(self, file=None):
        caught.append(self)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", capture)
    module = importlib.import_module(module_name)
    monkeypatch.setattr(sys, "argv", [module_name, "--help"])  # for a main() that reads sys.argv itself
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"]) if inspect.signature(module.main).parameters else module.main()
    assert exit_info.value.code == 0 and caught
    return caught[0]


@pytest.mark.parametrize("module_name", MODULES + BENCHMARKS)
def test_every_flag_has_a_help_text(module_name, monkeypatch):
    parser = _parser_of(module_name, monkeypatch)
    actions = [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]
    assert actions
    missing = [action.option_strings[0] if action.option_strings else action.dest for action in actions
               if not (action.help or "").strip()]
    assert not missing, f"{module_name}: no help text for {missing}"


def test_train_print_config_shows_every_key_and_round_trips(tmp_path, capsys):
    from syncseg.engine.config import all_keys
    from syncseg.engine.config import flatten, load_config

    train = importlib.import_module("syncseg.commands.train")
    assert train.main(["--config", "demo.yaml", "train.iters=7", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# train.py config: --config demo.yaml with train.iters=7")
    printed = yaml.safe_load(text)
    assert set(flatten(printed, "printed")) == set(all_keys())  # every key, the defaults too
    assert printed["train"]["iters"] == 7 and printed["train"]["momentum"] == 0.9  # override, default
    (tmp_path / "printed.yaml").write_text(text)
    assert load_config(tmp_path / "printed.yaml") == load_config("demo.yaml", ["train.iters=7"])
    assert train.main(["--print-config"]) == 2
    assert "--config is required" in capsys.readouterr().err


def test_print_config_of_a_resume_and_of_eval_reads_the_checkpoint(tmp_path, capsys):
    from syncseg.engine.checkpoint_file import FORMAT_VERSION, save_checkpoint
    from syncseg.engine.config import load_config, to_dict

    config = load_config("demo.yaml", [f"output_dir={tmp_path}", "train.iters=9", "eval.mode=whole"])
    save_checkpoint(tmp_path / "last.pt", {"format_version": FORMAT_VERSION, "model": {}, "config": to_dict(config),
                                           "classes": ["a"], "iteration": 3})
    train = importlib.import_module("syncseg.commands.train")
    assert train.main(["--config", "demo.yaml", f"output_dir={tmp_path}", "--resume", "auto", "train.iters=20",
                       "--print-config"]) == 0
    text = capsys.readouterr().out
    assert f"resuming {tmp_path / 'last.pt'} (iteration 3)" in text.splitlines()[0]
    assert yaml.safe_load(text)["train"]["iters"] == 20
    assert not (tmp_path / ".lock").exists()  # a preview takes no lock

    evaluate = importlib.import_module("syncseg.commands.eval")
    assert evaluate.main(["--checkpoint", str(tmp_path / "last.pt"), "--mode", "slide", "eval.stride=100",
                          "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["eval"]["mode"] == "slide" and printed["eval"]["stride"] == [100, 100]  # (height, width)
    assert printed["train"]["iters"] == 9 and printed["model"]["pretrained_backbone"] == "none"
    assert evaluate.main(["--checkpoint", str(tmp_path / "none.pt"), "--print-config"]) == 2
    assert "none.pt" in capsys.readouterr().err


# ------------------------------------------------------------------ the error contract (syncseg/engine/cli.py)
# each command's prog in its error lines -> its module
CONTRACT_CLIS = {"eval.py": "syncseg.commands.eval", "syncseg-predict": "syncseg.commands.predict",
                 "syncseg-export": "syncseg.commands.export", "syncseg-verify": "syncseg.commands.verify_dataset",
                 "syncseg-prepare-voc": "syncseg.commands.prepare_voc"}
WORK_FUNCTION = {"syncseg-verify": "verify", "syncseg-prepare-voc": "prepare"}  # default: run
ERROR_LINE = re.compile(r"\d\d:\d\d:\d\d (\S+): error: (.*)")


@pytest.mark.parametrize("path", ["train.py", *CONTRACT_CLIS])
def test_every_cli_points_to_the_contract_and_prints_no_error_line_of_its_own(path):
    module = importlib.import_module(CONTRACT_CLIS.get(path, "syncseg.commands.train"))
    source, docstring = Path(module.__file__).read_text(), module.__doc__
    assert "syncseg/engine/cli.py" in docstring, f"{path}'s docstring does not point to syncseg/engine/cli.py for its exit status"
    assert not re.search(r"""print\(f?["'][^"']*error:""", source), f"{path} formats an error line itself"


def _contract_arguments(module_name: str, tmp_path: Path) -> list[str]:
    return {"syncseg.commands.eval": ["--checkpoint", str(tmp_path / "c.pt")],
            "syncseg.commands.predict": ["--checkpoint", str(tmp_path / "c.pt"), "--input", str(tmp_path),
                                "--output", str(tmp_path / "out")],
            "syncseg.commands.export": ["--checkpoint", str(tmp_path / "c.pt"), "--format", "onnx"],
            "syncseg.commands.verify_dataset": ["--config", "demo.yaml"],
            "syncseg.commands.prepare_voc": ["--voc-root", str(tmp_path), "--sbd-root", str(tmp_path)]}[module_name]


@pytest.mark.parametrize("raised,code,message", [
    (ValueError("bad value"), 2, "bad value"),
    (PermissionError(13, "Permission denied", "/ro/out.json"), 1, "Permission denied: '/ro/out.json'"),
    (KeyboardInterrupt(), 130, None),
], ids=["ValueError", "OSError", "KeyboardInterrupt"])
@pytest.mark.parametrize("path", list(CONTRACT_CLIS))
def test_every_cli_maps_failures_to_the_contract(path, raised, code, message, tmp_path, monkeypatch, capsys):
    module = importlib.import_module(CONTRACT_CLIS[path])

    def body(*args, **kwargs):
        raise raised

    # the function holding each CLI's work, under the one run_command
    monkeypatch.setattr(module, WORK_FUNCTION.get(path, "run"), body)
    if path == "eval.py":  # eval.py sets up the launch first
        import syncseg.engine.distributed

        monkeypatch.setattr(syncseg.engine.distributed, "detect_launch", lambda: type("Launch", (), {"world_size": 1})())
    prog = path
    assert module.main(_contract_arguments(CONTRACT_CLIS[path], tmp_path)) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    if message is None:
        assert re.fullmatch(rf"\d\d:\d\d:\d\d {re.escape(prog)}: interrupted", lines[0])
    else:
        assert ERROR_LINE.fullmatch(lines[0]).groups() == (prog, message)


def test_verify_dataset_errors_follow_the_contract(tmp_path, capsys):
    verify = importlib.import_module("syncseg.commands.verify_dataset")
    assert verify.main(["--config", "demo.yaml", "data.root_typo=1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    prog, message = ERROR_LINE.fullmatch(line).groups()
    assert prog == "syncseg-verify" and "data.root_typo" in message
    blocker = tmp_path / "file.txt"  # writing under a regular file fails, also as root (unlike chmod)
    blocker.write_text("not a folder")
    output = blocker / "sub" / "stats.json"
    assert verify.main(["--config", "demo.yaml", "data.synthetic_val_size=2", "data.num_workers=0", "--splits", "val",
                        "--output", str(output)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ERROR_LINE.fullmatch(err[0]).groups() == (
        "syncseg-verify", f"could not write statistics '{output}': Not a directory: '{blocker / 'sub'}'")
