"""A stop in a 2-process gloo run saves at the step it was requested in, and one requested during a
validation or a PreciseBN pass ends it at its next batch; the resume runs the validation the stop cut short.

The two processes are started as torchrun starts its workers (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set), without torchrun's agent, and forked from the forkserver with the trainer imported
(tests.gloo.run_module_ranks): these claims are about the ranks' per-step agreement, and the agent cost each of
the 5 launches ~5 s and 2-3 CPU-s, a rank's own imports ~4.5 CPU-s (the file: 80 busy core-s as commands,
30 so). A stop under torchrun itself (the whole process group signalled, the next launch resuming by itself)
and train.py's own signal handling are tests/e2e/test_cluster.py's.

The signal reaches one rank only, from inside the step (or the validation batch) it is about: the other
rank learns of it through the per-step agreement (syncseg.engine.signals), so both must end at the same iteration.

Run as a module (`python -m tests.e2e.test_stop`, one process per rank; the tests' ranks run its main()), this
file trains, sends SIGTERM to its own process where STOP_AT says (`step:K:RANK`, `val:BATCH:RANK` or
`bn:BATCH:RANK`, a PreciseBN batch), and writes what each rank saw as JSON.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.common import TINY_BASE, read_metrics
from tests.gloo import free_port, run_module_ranks, torchrun_environment

TINY = [*TINY_BASE, "data.synthetic_val_size=5", "model.channels_last=false", "train.amp=off", "train.iters=4",
        "train.warmup_iters=1", "train.ckpt_interval=100", "eval.batch_size=1"]


def _run(tmp_path: Path, name: str, *, stop_at: str = "", resume: bool = False, extra: tuple[str, ...] = ()) -> list:
    """Train with 2 gloo processes, one per rank; returns each rank's JSON."""
    output = tmp_path / f"{name}.json"
    argv = [str(output), *(["--resume"] if resume else []), f"output_dir={tmp_path / 'run'}", *TINY, *extra]
    environments = [{**environment, "STOP_AT": stop_at} for environment in torchrun_environment(2, free_port())]
    run_module_ranks(main, argv, environments, [tmp_path / f"{name}.rank{rank}.log" for rank in (0, 1)])
    return [json.loads(output.with_suffix(f".{rank}.json").read_text()) for rank in (0, 1)]


def _last_pt(tmp_path: Path) -> dict:
    return torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_a_stop_requested_during_step_k_on_one_rank_saves_at_k_on_both(tmp_path):
    ranks = _run(tmp_path, "stop", stop_at="step:2:1", extra=("train.val_interval=100",))
    assert [rank["iteration"] for rank in ranks] == [2, 2]
    assert [rank["reason"] for rank in ranks] == ["signal", "signal"] and ranks[0]["signal"] == 15
    last = _last_pt(tmp_path)
    assert last["iteration"] == 2 and not last["validation_due"]
    assert sorted(ranks[0]["losses"]) == ["1", "2"]


@pytest.mark.slow
def test_a_stop_during_validation_ends_it_early_and_the_resume_runs_it_first(tmp_path):
    # 5 validation images: rank 0 has 3, rank 1 has 2; the signal comes during rank 1's last one, so rank 1
    # asks for the agreement once more after its shard is done and rank 0 must not start its third
    ranks = _run(tmp_path, "stop", stop_at="val:2:1", extra=("train.val_interval=2",))
    assert [rank["iteration"] for rank in ranks] == [2, 2]
    assert [rank["reason"] for rank in ranks] == ["signal", "signal"]
    assert [rank["val_batches"] for rank in ranks] == [2, 2]  # of 3 and 2: rank 0 stopped before its third
    assert [rank["val"] for rank in ranks] == [None, None]
    last = _last_pt(tmp_path)
    assert last["iteration"] == 2 and last["validation_due"]

    resumed = _run(tmp_path, "resumed", resume=True, extra=("train.val_interval=2",))
    assert [rank["val_batches"] for rank in resumed] == [3 + 3, 2 + 2]  # iteration 2's validation, then 4's
    assert resumed[0]["reason"] == "finished" and resumed[0]["iteration"] == 4
    assert sorted(resumed[0]["losses"]) == ["3", "4"]  # exact resume itself: tests/e2e/test_cluster.py
    validations = read_metrics(tmp_path / "run")
    validated = [record["iteration"] for record in validations if record.get("type") == "val"]
    assert validated == [2, 4]


@pytest.mark.slow
def test_a_stop_during_precise_bn_on_one_rank_ends_the_pass_at_the_same_batch_on_both(tmp_path):
    # 30 PreciseBN batches; the signal comes inside rank 1's third: both ranks end the pass there (their
    # synchronized layers and agreements stay paired), save last.pt with the validation due, and the
    # resume runs PreciseBN and the validation of iteration 2 first
    extra = ("train.val_interval=2", "train.precise_bn_batches=30")
    ranks = _run(tmp_path, "stop", stop_at="bn:3:1", extra=extra)
    assert [rank["iteration"] for rank in ranks] == [2, 2] and [rank["bn_batches"] for rank in ranks] == [3, 3]
    assert [rank["reason"] for rank in ranks] == ["signal", "signal"] and ranks[0]["signal"] == 15
    last = _last_pt(tmp_path)
    assert last["iteration"] == 2 and last["validation_due"]

    resumed = _run(tmp_path, "resumed", resume=True, extra=extra)
    assert [rank["bn_batches"] for rank in resumed] == [30 + 30, 30 + 30] and resumed[0]["iteration"] == 4
    validations = read_metrics(tmp_path / "run")
    assert [record["iteration"] for record in validations if record.get("type") == "val"] == [2, 4]


def main(argv: list[str]) -> int:
    """`python -m tests.e2e.test_stop OUTPUT [--resume] KEY=VALUE...` per rank (torchrun's variables set), from
    the repository root."""
    import logging
    import signal

    import syncseg.engine.evaluate
    import syncseg.engine.precise_bn
    from syncseg.engine.allocator import keep_freed_memory
    from syncseg.engine.checkpoint_file import RESUME_KEYS, load_checkpoint
    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import cleanup, setup_distributed
    from syncseg.engine.trainer import Trainer

    keep_freed_memory()  # as train.py does, before the first large tensor
    output, resume = Path(argv[0]), argv[1:2] == ["--resume"]
    overrides = argv[2:] if resume else argv[1:]
    info = setup_distributed(None)
    logging.basicConfig(level=logging.INFO if info.is_main else logging.WARNING)
    config = load_config("demo.yaml", overrides)
    payload = load_checkpoint(config.run_dir / "last.pt", required_keys=RESUME_KEYS) if resume else None
    trainer = Trainer.from_config(config, info, resume=payload, progress=False)
    where, _, rest = os.environ.get("STOP_AT", "").partition(":")
    count, rank = (int(value) for value in rest.split(":")) if where else (0, -1)
    seen = {"step": 0, "val": 0, "bn": 0}

    def signalling(function, kind):
        def wrapped(*args, **kwargs):
            seen[kind] += 1
            value = function(*args, **kwargs)
            if kind == where and seen[kind] == count and info.rank == rank:
                os.kill(os.getpid(), signal.SIGTERM)  # inside the step / the batch it is about
            return value
        return wrapped

    trainer.train_step = signalling(trainer.train_step, "step")
    syncseg.engine.evaluate.predict_batch = signalling(syncseg.engine.evaluate.predict_batch, "val")
    syncseg.engine.precise_bn.normalize_batch = signalling(syncseg.engine.precise_bn.normalize_batch, "bn")
    result = trainer.fit()
    output.with_suffix(f".{info.rank}.json").write_text(json.dumps({
        "iteration": result.iteration, "reason": result.reason, "signal": result.signal, "val_batches": seen["val"],
        "bn_batches": seen["bn"],
        "losses": {str(k): v for k, v in result.losses.items()},
        "val": result.last_val and {k: result.last_val[k] for k in ("miou", "num_images")},
    }))
    trainer.close()
    cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
