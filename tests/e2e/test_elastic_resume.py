"""Multi-process (gloo, CPU) training equals one process on the same global batches, and a run saved at one world
size and resumed at another trains on as one process would. One float64 run of 6 iterations on one process is
compared with a chain of launches over one run dir: 2 processes for iterations 1-2, resumed by 3
processes for 3-4 (2 -> 3, a world that grows), then by 2 again for 5-6 (3 -> 2, one that shrinks). The global
batch of 8 is split 4,4 and 3,3,2 (uneven); with 24 samples an epoch is 3 steps, so the resumes land mid-epoch
and the 3-process leg crosses an epoch boundary. (Two and three processes, not four: the 2-core CI machine pays
every process's start-up, and a world that shrinks, grows and splits unevenly needs no more; 16 processes:
test_large_world.) The ranks get the variables torchrun gives its workers, without torchrun's agent, and fork
from the forkserver with the trainer imported (tests.gloo.run_module_ranks): the claims are the ranks', and as
torchrun launches the test took 87-101 busy core-seconds, mostly every rank's imports. torchrun itself (its
agent, a restart after a killed worker, a resume at the same world size): tests/e2e/test_cluster.py.

This is what synchronized BatchNorm buys: with `model.norm=syncbn` every step normalizes with the statistics
of the global batch, so the losses, the final weights and the BatchNorm running statistics match the single
process's; with plain `bn` (per-process statistics) they do not, which the negative control checks at step 1.
Every leg validates at its last iteration, sharded over its processes (6 images: 3,3 and 2,2,2) with the
confusion matrix all-reduced: the same mIoU as the single process's. (This file took over the 2-process test
of test_train_ddp.py, whose claims were its first leg's; uneven validation shards: tests/engine/test_evaluate.py.)

The comparisons run in float64 (tests/float64.py says why): the runs agree to ~1e-14 there, where float32 runs
of a 2-process test differed by 2e-6 on one CPU and 6e-3 on another. Dropout is disabled: its masks come from
per-process random streams and cannot match between 1 and 2 processes.

Run as a module (under torchrun or alone; the tests' ranks run its main()), this file trains through the run
plan, so `--resume auto` decides as train.py does: `python -m tests.e2e.test_elastic_resume OUTPUT STOP_AT
KEY=VALUE...` trains up to STOP_AT (saving last.pt there) and writes that launch's losses as JSON.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.common import TINY_BASE, read_metrics
from tests.gloo import free_port, plain_environment, run_module_ranks, torchrun_environment

TINY = [*TINY_BASE, "data.scale_range=0.75,1.25", "data.synthetic_val_size=6", "model.channels_last=false",
        "train.warmup_iters=1", "train.amp=off", "train.optimizer=sgd", "train.lr=0.01", "train.head_lr_mult=10",
        "eval.batch_size=2"]
TOLERANCE = 1e-6  # float64 runs of different splits agree to ~1e-13; a float32 run would miss by ~1e-3


ITERS = 6
ELASTIC = [*TINY, "model.norm=syncbn", "data.synthetic_train_size=24", "train.batch_size=8", f"train.iters={ITERS}",
           "train.val_interval=2", "train.ckpt_interval=1000"]
TIMEOUT = 240  # seconds per launch; each takes 2-10 s on 2 shared CPU cores


def _launch(run_dir: Path, output: Path, *, processes: int, stop_at: int, extra: tuple[str, ...] = ()
            ) -> tuple[dict, str]:
    """One launch: `processes` ranks as torchrun starts its workers (one process: none of its variables);
    returns rank 0's JSON and every rank's log."""
    argv = [str(output), str(stop_at), f"output_dir={run_dir}", *ELASTIC, *extra]
    environments = torchrun_environment(processes, free_port()) if processes > 1 else [plain_environment()]
    logs = [output.with_suffix(f".rank{rank}.log") for rank in range(processes)]
    run_module_ranks(main, argv, environments, logs, timeout=TIMEOUT)
    return json.loads(output.read_text()), "\n".join(log.read_text() for log in logs)


def _final_model(path: Path) -> tuple[dict, dict]:
    """(the BatchNorm buffers, the whole state dict) of the model saved in `path` at the last iteration."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["iteration"] == ITERS
    return {name: tensor for name, tensor in state["model"].items()
            if name.endswith(("running_mean", "running_var", "num_batches_tracked"))}, state["model"]


@pytest.mark.slow
def test_a_run_saved_at_two_processes_resumed_at_three_and_back_equals_one_process(tmp_path):
    started = time.monotonic()
    single, _ = _launch(tmp_path / "single", tmp_path / "single.json", processes=1, stop_at=ITERS)
    run_dir = tmp_path / "elastic"
    legs = [(2, 2), (3, 4), (2, ITERS)]  # (processes, stop at): 2 -> 3 -> 2
    losses, logs = {}, []
    for index, (processes, stop_at) in enumerate(legs):
        leg, log = _launch(run_dir, tmp_path / f"leg{index}.json", processes=processes, stop_at=stop_at)
        losses.update(leg["losses"])
        logs.append(log)
    print(f"\nelastic resume test: {time.monotonic() - started:.0f} s for one 1-process and three multi-process "
          "launches")

    steps = [str(step) for step in range(1, ITERS + 1)]
    assert sorted(losses, key=int) == sorted(single["losses"], key=int) == steps
    differences = {step: abs(losses[step] - single["losses"][step]) for step in steps}
    print("elastic resume test: |loss difference| per step:",
          ", ".join(f"{step}: {value:.1e}" for step, value in differences.items()))
    assert max(differences.values()) <= TOLERANCE, differences
    assert len(set(single["losses"].values())) == ITERS  # the steps train: a stuck loss would compare trivially

    # the final model: the BatchNorm running statistics (the global batches') and every other tensor
    single_bn, single_model = _final_model(tmp_path / "single" / "last.pt")
    elastic_bn, elastic_model = _final_model(run_dir / "last.pt")
    assert single_bn.keys() == elastic_bn.keys() and len(single_bn) > 10
    assert elastic_model.keys() == single_model.keys()
    for name, tensor in single_model.items():
        other = elastic_model[name]
        assert other.dtype == tensor.dtype, name
        if tensor.is_floating_point():
            torch.testing.assert_close(other, tensor, atol=TOLERANCE, rtol=0, msg=name)
        else:
            assert torch.equal(other, tensor), name

    def largest_difference(names) -> float:
        return max(float((elastic_model[name] - single_model[name]).abs().max()) for name in names)

    statistics = [name for name in single_bn if single_bn[name].is_floating_point()]
    weights = [name for name, tensor in single_model.items() if tensor.is_floating_point() and name not in single_bn]
    print(f"elastic resume test: largest difference of the weights {largest_difference(weights):.1e}, of the "
          f"BatchNorm running statistics {largest_difference(statistics):.1e}")
    assert all(int(single_bn[name]) == ITERS for name in single_bn if name.endswith("num_batches_tracked"))

    # the launches resumed, and rank 0 said what the new world size changes
    assert "DDP over 2 processes; global batch 8, per-device batch 4; BN statistics across the processes through " \
        "torch.distributed" in logs[0]
    assert "resuming" not in logs[0]
    assert f"resuming {run_dir / 'last.pt'} at iteration 2" in logs[1]
    assert f"resuming {run_dir / 'last.pt'} at iteration 4" in logs[2]
    assert "resumed from world size 2 at world size 3: per-device batch 3,3,2 (was 4)" in logs[1]
    assert "resumed from world size 3 at world size 2: per-device batch 4 (was 3,3,2)" in logs[2]
    for log in logs[1:]:
        assert "global batch 8 unchanged; data order unchanged (the same global order of samples" in log
        assert "BN statistics still those of the whole (micro-)batch" in log

    # every leg's validation, sharded over its processes, gives the single process's
    validations = {name: {r["iteration"]: r for r in read_metrics(folder) if r["type"] == "val"}
                   for name, folder in (("single", tmp_path / "single"), ("elastic", run_dir))}
    assert sorted(validations["elastic"]) == sorted(validations["single"]) == [2, 4, ITERS]
    for iteration, expected in validations["single"].items():
        got = validations["elastic"][iteration]
        assert got["num_images"] == expected["num_images"] == 6, iteration
        assert got["miou"] == pytest.approx(expected["miou"], abs=1e-9), iteration

    # negative control: per-process BN statistics normalize differently from the first forward on
    unsynced, log = _launch(tmp_path / "bn", tmp_path / "bn.json", processes=2, stop_at=1, extra=("model.norm=bn",))
    assert "not synchronized" in log
    assert abs(unsynced["losses"]["1"] - single["losses"]["1"]) > 1000 * TOLERANCE


def main(argv: list[str]) -> int:
    import logging

    from torch import nn

    from syncseg.engine.allocator import keep_freed_memory
    from syncseg.engine.distributed import cleanup, setup_distributed
    from syncseg.engine.run_plan import plan_run
    from syncseg.engine.trainer import Trainer
    from tests.float64 import trainers_in_float64

    keep_freed_memory()  # as train.py does, before the first large tensor
    output, stop_at, overrides = Path(argv[0]), int(argv[1]), argv[2:]
    info = setup_distributed(None if "WORLD_SIZE" in os.environ else "cpu")
    logging.basicConfig(level=logging.INFO if info.is_main else logging.WARNING)
    plan = plan_run("demo.yaml", "auto", overrides, dist_info=info)
    trainer = None
    try:
        with trainers_in_float64():
            trainer = Trainer.from_config(plan.config, info, resume=plan.resume, run_id=plan.run_id,
                                          overrides=plan.overrides, progress=False)
        plan.resume = None
        for module in trainer.model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        result = trainer.fit(stop_at=stop_at)
        if info.is_main:
            output.write_text(json.dumps({"losses": {str(k): v for k, v in result.losses.items()}}))
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        plan.release()
    cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
