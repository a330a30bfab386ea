"""Unit tests of the training engine's pieces, each against an independent reference."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.trainer import (
    PolyWarmupLR,
    ResumableBatchSampler,
    SeededDataset,
    SegmentationLoss,
    ShardSampler,
    build_optimizer,
    capture_rng_state,
    poly_warmup_factor,
    restore_rng_state,
)


def _logits_and_target(seed: int = 0, num_classes: int = 4, shape=(2, 5, 6), ignore_fraction=0.2):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape[0], num_classes, *shape[1:], generator=generator) * 2
    target = torch.randint(0, num_classes, shape, generator=generator)
    ignored = torch.rand(shape, generator=generator) < ignore_fraction
    target[ignored] = 255
    return logits, target


# ------------------------------------------------------------------------------------------- loss
def test_loss_equals_torch_cross_entropy_with_ignore_index():
    logits, target = _logits_and_target()
    loss = SegmentationLoss(ignore_index=255)({"out": logits}, target)
    reference = F.cross_entropy(logits, target, ignore_index=255)
    torch.testing.assert_close(loss, reference)


def test_loss_with_class_weights_equals_torch_weighted_mean():
    logits, target = _logits_and_target(seed=1)
    weights = [0.5, 2.0, 1.0, 3.0]
    loss = SegmentationLoss(class_weights=weights)({"out": logits}, target)
    reference = F.cross_entropy(logits, target, weight=torch.tensor(weights), ignore_index=255)
    torch.testing.assert_close(loss, reference)


def test_aux_loss_is_weighted_sum_of_heads():
    logits, target = _logits_and_target(seed=2)
    aux, _ = _logits_and_target(seed=3)
    loss = SegmentationLoss(aux_weight=0.4)({"out": logits, "aux": aux}, target)
    reference = F.cross_entropy(logits, target, ignore_index=255) + 0.4 * F.cross_entropy(aux, target, ignore_index=255)
    torch.testing.assert_close(loss, reference)


def _ohem_reference(logits: torch.Tensor, target: torch.Tensor, thresh: float, min_kept: int) -> float:
    """float64 numpy recomputation of OHEM: keep pixels with p(true) < thresh, at least min_kept."""
    z = logits.double().numpy()
    z = z - z.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    t = target.numpy()
    valid = t != 255
    n, _, h, w = z.shape
    losses, probs = [], []
    for i in range(n):
        for y in range(h):
            for x in range(w):
                if valid[i, y, x]:
                    p = prob[i, t[i, y, x], y, x]
                    probs.append(p)
                    losses.append(-np.log(p))
    probs, losses = np.array(probs), np.array(losses)
    threshold = max(thresh, np.sort(probs)[min(min_kept, len(probs)) - 1])
    kept = probs <= threshold
    return float(losses[kept].mean())


@pytest.mark.parametrize("thresh,min_kept", [(0.7, 5), (0.3, 20), (0.05, 1)])
def test_ohem_matches_float64_reference(thresh, min_kept):
    logits, target = _logits_and_target(seed=4)
    loss = SegmentationLoss(ohem=True, ohem_thresh=thresh, ohem_min_kept=min_kept)({"out": logits}, target)
    assert loss.item() == pytest.approx(_ohem_reference(logits, target, thresh, min_kept), rel=1e-5)


def test_ohem_keeps_fewer_pixels_than_plain_loss_and_is_harder():
    logits, target = _logits_and_target(seed=5)
    plain = SegmentationLoss()({"out": logits}, target)
    hard = SegmentationLoss(ohem=True, ohem_thresh=0.3, ohem_min_kept=1)({"out": logits}, target)
    assert hard > plain  # only low-probability (high-loss) pixels remain


def test_loss_of_all_ignored_batch_is_zero_not_nan():
    logits = torch.randn(1, 3, 4, 4, requires_grad=True)
    target = torch.full((1, 4, 4), 255)
    loss = SegmentationLoss()({"out": logits}, target)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()


def test_loss_rejects_mask_values_out_of_range():
    logits = torch.randn(1, 3, 2, 2)
    target = torch.tensor([[[0, 1], [2, 7]]])
    with pytest.raises(ValueError, match="mask value 7"):
        SegmentationLoss()({"out": logits}, target)


# -------------------------------------------------------------------------------------- schedule
def test_poly_schedule_matches_torch_polynomial_lr():
    params = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD([{"params": params, "lr": 0.1}], lr=0.1)
    reference_opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1}], lr=0.1)
    scheduler = PolyWarmupLR(optimizer, total_iters=20, power=0.9)
    reference = torch.optim.lr_scheduler.PolynomialLR(reference_opt, total_iters=20, power=0.9)
    for _ in range(20):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_opt.param_groups[0]["lr"], rel=1e-9)
        optimizer.step(), reference_opt.step()
        scheduler.step(), reference.step()


def test_warmup_matches_torch_linear_then_polynomial_chain():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    reference_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    warmup = 5
    scheduler = PolyWarmupLR(optimizer, total_iters=30, power=0.9, warmup_iters=warmup)
    reference = torch.optim.lr_scheduler.ChainedScheduler([
        torch.optim.lr_scheduler.LinearLR(reference_opt, start_factor=1 / warmup, total_iters=warmup - 1),
        torch.optim.lr_scheduler.PolynomialLR(reference_opt, total_iters=30, power=0.9),
    ])
    for _ in range(30):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_opt.param_groups[0]["lr"], rel=1e-9)
        optimizer.step(), reference_opt.step()
        scheduler.step(), reference.step()


def test_schedule_state_restores_lr_and_keeps_group_ratio():
    head, backbone = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    groups = [{"name": "backbone", "params": [backbone], "lr": 0.01, "weight_decay": 0.0},
              {"name": "head", "params": [head], "lr": 0.1, "weight_decay": 0.0}]
    optimizer = build_optimizer(groups, _TrainCfg())
    scheduler = PolyWarmupLR(optimizer, total_iters=10, power=1.0)
    for _ in range(4):
        scheduler.step()
    lrs = scheduler.get_last_lr()
    assert lrs[1] / lrs[0] == pytest.approx(10.0)
    assert lrs[0] == pytest.approx(0.01 * poly_warmup_factor(4, total_iters=10, power=1.0, warmup_iters=0))
    fresh = PolyWarmupLR(build_optimizer([dict(g) for g in groups], _TrainCfg()), total_iters=10, power=1.0)
    fresh.load_state_dict(scheduler.state_dict())
    assert fresh.get_last_lr() == pytest.approx(lrs)


class _TrainCfg:
    optimizer = "sgd"
    lr = 0.01
    momentum = 0.9
    weight_decay = 0.0


def test_build_optimizer_adamw_and_unknown():
    params = [torch.nn.Parameter(torch.zeros(1))]
    cfg = _TrainCfg()
    cfg.optimizer = "adamw"
    assert isinstance(build_optimizer([{"params": params}], cfg), torch.optim.AdamW)
    cfg.optimizer = "lamb"
    with pytest.raises(ValueError, match="lamb"):
        build_optimizer([{"params": params}], cfg)


# ------------------------------------------------------------------------------------ data order
def test_sampler_shards_the_single_process_global_batches():
    single = ResumableBatchSampler(50, batch_size=8, seed=3)
    single.set_epoch(2)
    shards = []
    for rank in range(2):
        sampler = ResumableBatchSampler(50, batch_size=4, seed=3, rank=rank, world_size=2)
        sampler.set_epoch(2)
        shards.append(list(sampler))
    expected = list(single)
    assert len(expected) == 50 // 8
    for step, batch in enumerate(expected):
        assert shards[0][step] + shards[1][step] == batch


def test_sampler_epochs_differ_cover_distinct_samples_and_resume_skips():
    sampler = ResumableBatchSampler(40, batch_size=4, seed=0)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1
    indices = [index for batch in epoch0 for index, _ in batch]
    assert sorted(indices) == list(range(40))
    sampler.set_epoch(0, start_batch=3)
    assert list(sampler) == epoch0[3:] and len(sampler) == len(epoch0) - 3
    again = ResumableBatchSampler(40, batch_size=4, seed=0)
    again.set_epoch(1)
    assert list(again) == epoch1
    other_seed = ResumableBatchSampler(40, batch_size=4, seed=1)
    assert list(other_seed) != epoch0


def test_sampler_rejects_dataset_smaller_than_global_batch():
    with pytest.raises(ValueError, match="train.batch_size"):
        ResumableBatchSampler(3, batch_size=2, seed=0, world_size=2)


def test_shard_sampler_covers_every_index_once():
    shards = [list(ShardSampler(11, rank=r, world_size=3)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(11))


class _RandomDataset(Dataset):
    """Every draw source a data pipeline may use: torch, numpy, python random, an albumentations-like
    pipeline with its own generator."""

    class _Pipeline:
        def __init__(self):
            self.rng = np.random.default_rng()

        def set_random_seed(self, seed):
            self.rng = np.random.default_rng(seed)

    def __init__(self):
        self.transform = self._Pipeline()

    def __len__(self):
        return 10

    def __getitem__(self, index):
        return torch.tensor([index, torch.rand(()).item(), np.random.rand(), random.random(),
                             self.transform.rng.random()], dtype=torch.float64)


def test_seeded_dataset_is_a_function_of_index_and_seed_and_leaves_global_rng_alone():
    dataset = SeededDataset(_RandomDataset())
    torch.manual_seed(0)
    before = torch.rand(())
    torch.manual_seed(0)
    first = dataset[(3, 42)]
    assert torch.rand(()) == before  # global stream untouched
    second = dataset[(3, 42)]
    other = dataset[(3, 43)]
    assert torch.equal(first, second)
    assert (first[1:] != other[1:]).all()  # every random source follows the sample seed


def test_seeded_loading_is_independent_of_worker_count():
    sampler = ResumableBatchSampler(10, batch_size=2, seed=5)
    results = []
    for workers in (0, 2):
        loader = DataLoader(SeededDataset(_RandomDataset()), batch_sampler=sampler, num_workers=workers)
        results.append(torch.cat(list(loader)))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_dataloader_with_own_generator_does_not_consume_global_rng():
    loader = DataLoader(list(range(4)), batch_size=2, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    list(loader)
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------------------------------- RNG
def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # leave a cached gaussian in both states
    state = capture_rng_state()
    expected = (random.random(), random.gauss(0, 1), np.random.rand(3), np.random.standard_normal(), torch.rand(3))
    path = tmp_path / "rng.pt"
    save_checkpoint(path, {"format_version": 1, "model": {}, "config": {}, "classes": [], "rng": state})
    loaded = load_checkpoint(path)["rng"]
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(loaded)
    got = (random.random(), random.gauss(0, 1), np.random.rand(3), np.random.standard_normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and got[3] == expected[3]
    np.testing.assert_array_equal(got[2], expected[2])
    assert torch.equal(got[4], expected[4])


# --------------------------------------------------------------------------------------- logging
def test_metrics_log_restarts_for_a_fresh_run_and_trims_for_a_resume(tmp_path):
    import json

    from engine.trainer import MetricsLog

    lines = [{"type": "train", "iteration": i, "loss": float(i)} for i in (1, 2, 3, 4)]
    path = tmp_path / "metrics.jsonl"

    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    log = MetricsLog(tmp_path, enabled=True, resume_iteration=2)  # resumed from a checkpoint at 2
    log.scalars({"loss": 9.0}, step=3, prefix="train")
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["iteration"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 9.0)]

    log = MetricsLog(tmp_path, enabled=True)  # a fresh run in the same directory
    log.scalars({"loss": 5.0, "lr": {"head": 0.1}}, step=1, prefix="train")
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"type": "train", "iteration": 1, "loss": 5.0, "lr": {"head": 0.1}}]
