"""Gradient accumulation (train.accumulate): the same global batch, loss and gradient per optimizer
step, the same schedule and exact resume; under DDP one gradient all-reduce per optimizer step."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from syncseg.engine.accumulation import describe_batches, describe_world_change, step_normalizer
from syncseg.engine.checkpoint_file import RESUME_KEYS, load_checkpoint
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.config import TrainConfig
from syncseg.engine.loss import SegmentationLoss, build_loss
from syncseg.engine.samplers import train_steps
from syncseg.engine.trainer import Trainer
from tests.float64 import trainers_in_float64
from tests.gloo import free_port, init_gloo, start_ranks

# 32 px crops of 24-40 px images: the crops carry different amounts of ignore padding, so a micro-batch
# normalized by its own pixels (instead of the step's) gives a visibly different gradient
TINY = [
    "data.synthetic_image_size=32", "data.crop_size=32", "data.scale_range=0.75,1.25", "data.hflip=false",
    "data.synthetic_train_size=16", "data.synthetic_val_size=2", "data.num_workers=0",
    "model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1", "model.channels_last=false",
    "model.aux_loss=true", "train.amp=off", "eval.amp=off", "train.batch_size=8", "train.warmup_iters=1",
    "train.log_interval=1", "train.val_interval=100", "train.ckpt_interval=100", "train.num_vis_images=0",
]


def _loss(**settings) -> SegmentationLoss:
    return build_loss(TrainConfig(**settings), ignore_index=255)


def _trainer(tmp_path: Path, name: str, *overrides: str, dist_info: DistInfo | None = None,
             float64: bool = False) -> Trainer:
    """float64 for comparisons between splits of a batch (tests/float64.py)."""
    config = load_config("demo.yaml", [f"output_dir={tmp_path / name}", *TINY, *overrides])
    with trainers_in_float64() if float64 else contextlib.nullcontext():
        trainer = Trainer.from_config(config, dist_info or DistInfo(), progress=False)
    for module in trainer.model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # dropout masks depend on how the batch is split
    return trainer


def _first_step_gradients(trainer: Trainer) -> tuple[dict[str, torch.Tensor], float, torch.Tensor]:
    """Gradients, loss and masks of the first optimizer step with every norm layer in eval mode."""
    micro_batches = next(train_steps(trainer.parts.train_loader, 0))
    trainer.model.train()
    for module in trainer.model.modules():
        if isinstance(module, _BatchNorm):
            module.eval()  # running statistics: the split cannot change what BatchNorm computes
    loss = trainer.train_step(micro_batches)
    gradients = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.close()
    return gradients, float(loss), torch.cat([masks for _, masks in micro_batches])


def _assert_same_gradients(actual: dict, expected: dict, *, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 50
    for name, gradient in expected.items():
        torch.testing.assert_close(actual[name], gradient, atol=atol, rtol=0, msg=name)
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-3  # not vacuous
    assert all(g.dtype == torch.float64 for g in expected.values())  # float64: see tests/float64.py


@pytest.mark.parametrize("extra", [(), ("train.class_weights=0.5,1,2,1,1,3",),
                                   ("train.loss=ce:1,focal:0.5,dice:1,lovasz:0.5", "train.class_weights=0.5,1,2,1,1,3")],
                         ids=["plain", "class_weights", "every_loss"])
def test_batch_8x1_and_4x2_give_the_same_gradients_with_norm_layers_in_eval_mode(tmp_path, monkeypatch, extra):
    whole, whole_loss, whole_masks = _first_step_gradients(_trainer(tmp_path, "whole", *extra, float64=True))
    split, split_loss, split_masks = _first_step_gradients(_trainer(tmp_path, "split", "train.accumulate=2", *extra,
                                                                    float64=True))
    assert torch.equal(split_masks, whole_masks)  # the two micro-batches are the global batch, in order
    counts = [int((masks != 255).sum()) for masks in split_masks.split(4)]
    assert counts[0] != counts[1]  # the micro-batches weigh differently, so the normalizer matters
    assert split_loss == pytest.approx(whole_loss, abs=1e-6, rel=0)
    _assert_same_gradients(split, whole)

    # control: normalizing each micro-batch by its own pixels (a plain mean per micro-batch) is wrong
    monkeypatch.setattr("syncseg.engine.trainer.step_normalizer", lambda criterion, masks: None)
    naive, _, _ = _first_step_gradients(_trainer(tmp_path, "naive", "train.accumulate=2", *extra, float64=True))
    assert max(float((naive[k] - whole[k]).abs().max()) for k in whole) > 1e-4


def test_step_normalizer_is_the_valid_pixel_weight_of_the_whole_step():
    masks = [torch.tensor([[0, 1, 255], [2, 255, 255]]), torch.tensor([[1, 1, 1], [255, 0, 2]])]
    plain = _loss()
    assert step_normalizer(plain, masks[:1]) is None  # one micro-batch: the loss normalizes itself
    assert float(step_normalizer(plain, masks)) == 3 + 5
    weighted = _loss(class_weights=(0.5, 2.0, 4.0))
    assert float(step_normalizer(weighted, masks)) == (0.5 + 2 + 4) + (2 * 3 + 0.5 + 4)
    with pytest.raises(RuntimeError, match="OHEM"):
        step_normalizer(_loss(ohem=True), masks)


def test_describe_batches_states_micro_batches_and_per_micro_batch_statistics():
    assert describe_batches(8, accumulate=1, num_replicas=3, batch_norm="synced") == (
        "global batch 8, per-device batch 3,3,2; BN statistics synced")
    assert describe_batches(16, accumulate=2, num_replicas=2, batch_norm="synced") == (
        "global batch 16 in 2 accumulated micro-batches of 8, per-device batch 4; BN statistics per micro-batch, synced")
    assert "micro-batches of 4,3,3, per-device batch 2,1;" in describe_batches(10, accumulate=3, num_replicas=2,
                                                                                 batch_norm="synced")


def test_describe_world_change_states_the_new_split_and_what_stays():
    line = describe_world_change(4, 3, global_batch=8, accumulate=1, num_replicas=3, global_statistics=True)
    assert line.startswith("resumed from world size 4 at world size 3: per-device batch 3,3,2 (was 2), global batch "
                           "8 unchanged; data order unchanged (the same global order of samples")
    assert "BN statistics still those of the whole (micro-)batch" in line and "(train.seed, rank, iteration)" in line
    per_device = describe_world_change(2, 4, global_batch=16, accumulate=2, num_replicas=4, global_statistics=False)
    assert "per-device batch 2 (was 4)" in per_device and "steps differ from an unchanged world size's" in per_device


@pytest.mark.slow
def test_accumulated_run_resumes_exactly_and_schedules_per_optimizer_step(tmp_path):
    steps = ["train.iters=4", "train.accumulate=2", "train.optimizer=adamw"]
    straight = _trainer(tmp_path, "straight", *steps)
    expected = straight.fit().losses
    straight.close()
    first = _trainer(tmp_path, "split", *steps)
    first.fit(stop_at=2)
    first.close()
    resume = load_checkpoint(tmp_path / "split" / "last.pt", required_keys=RESUME_KEYS)
    assert resume["iteration"] == 2
    second = Trainer.from_config(load_config("demo.yaml", [f"output_dir={tmp_path / 'split'}", *TINY, *steps]), DistInfo(),
                     resume=resume, progress=False)
    for module in second.model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    resumed = second.fit().losses
    assert sorted(expected) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert resumed == {k: expected[k] for k in (3, 4)}  # bit for bit on the CPU
    # the schedule and the optimizer count optimizer steps, not micro-batches
    assert second.parts.scheduler.iteration == 4
    assert {int(state["step"]) for state in second.optimizer.state.values()} == {4}
    second.close()


# ------------------------------------------------------------------------------------- 2-rank DDP
def _ddp_worker(rank: int, port: int, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, 2, port, timeout_s=120)
    try:
        info = DistInfo(rank=rank, world_size=2, mode="ddp")
        results = {}
        for accumulate in (1, 2):
            trainer = _trainer(tmp_path, f"ddp{accumulate}", "train.iters=2", f"train.accumulate={accumulate}",
                               dist_info=info)
            events: list[str] = []

            def counting_allreduce(state, bucket):
                events.append("allreduce")
                return dist.all_reduce(bucket.buffer().div_(2), async_op=True).get_future().then(
                    lambda future: future.value()[0])

            trainer.parts.train_model.register_comm_hook(None, counting_allreduce)
            trainer.parts.train_model.register_forward_pre_hook(lambda module, args: events.append("forward"))
            trainer.fit()
            results[accumulate] = events
            trainer.close()
            del trainer
        # the gradient of one accumulated step under DDP, every norm layer in eval mode
        trainer = _trainer(tmp_path, "ddp_gradients", "train.accumulate=2", dist_info=info, float64=True)
        gradients, loss, masks = _first_step_gradients(trainer)
        del trainer
        if rank == 0:
            torch.save({"events": results, "gradients": gradients}, tmp_path / "ddp.pt")
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


def _steps(events: list[str]) -> list[tuple[int, int]]:
    """["forward", "forward", "allreduce", "forward", ...] -> [(2, 1), ...]: each step is its forward passes,
    then its all-reduces."""
    steps: list[list[int]] = []
    for event in events:
        if event == "forward" and (not steps or steps[-1][1]):
            steps.append([0, 0])
        steps[-1][event == "allreduce"] += 1
    return [tuple(step) for step in steps]


@pytest.mark.slow
def test_two_rank_ddp_all_reduces_gradients_once_per_optimizer_step_and_matches_one_process(tmp_path):
    start_ranks(_ddp_worker, (free_port(), tmp_path), 2)
    saved = torch.load(tmp_path / "ddp.pt", weights_only=True)
    steps = {accumulate: _steps(events) for accumulate, events in saved["events"].items()}
    # (forward passes, gradient all-reduces) per optimizer step; DDP may rebuild its buckets after the
    # first step, so the all-reduce count is compared step by step with the run without accumulation
    assert [forwards for forwards, _ in steps[1]] == [1, 1]
    assert [forwards for forwards, _ in steps[2]] == [2, 2]  # and no all-reduce between them (no_sync)
    assert [reduces for _, reduces in steps[2]] == [reduces for _, reduces in steps[1]]
    assert all(reduces >= 1 for _, reduces in steps[1])
    # and what the all-reduce sums is the gradient of the global batch: one process, no accumulation
    single, _, _ = _first_step_gradients(_trainer(tmp_path, "single", float64=True))
    _assert_same_gradients(saved["gradients"], single)
