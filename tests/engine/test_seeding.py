"""Per-sample seeding, worker seeding and RNG capture/restore."""
from __future__ import annotations

import random

import cv2
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from syncseg.engine.checkpoint_file import load_checkpoint, save_checkpoint
from syncseg.engine.samplers import ResumableBatchSampler
from syncseg.engine import seeding
from syncseg.engine.seeding import SeededDataset, capture_rng_state, restore_rng_state, worker_init


class _RandomDataset(Dataset):
    """Every draw source a data pipeline may use: torch, numpy, python random, an albumentations-like
    pipeline with its own generator, seeded from torch as syncseg.data.transforms.PairTransform seeds it."""

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
        self.transform.set_random_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
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


@pytest.mark.parametrize("in_worker", [False, True])
def test_seeded_dataset_never_reseeds_the_gpus_and_restores_every_host_state(monkeypatch, in_worker):
    """torch.manual_seed also seeds every CUDA generator, and only the host states were restored: each
    PreciseBN pass (always in the main process) reset the GPUs' streams, so dropout repeated after every
    validation. Loading a sample must seed the host generators only."""
    cuda_seeds = []
    for name in ("manual_seed_all", "manual_seed"):
        monkeypatch.setattr(torch.cuda, name, lambda seed, _name=name: cuda_seeds.append((_name, seed)))
    if in_worker:  # a worker's streams serve nothing else, but it must not touch CUDA either
        monkeypatch.setattr(seeding, "get_worker_info", lambda: object())
    dataset = SeededDataset(_RandomDataset())
    torch.manual_seed(0), np.random.seed(1), random.seed(2)
    cuda_seeds.clear()
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    first = dataset[(3, 42)]
    assert cuda_seeds == []
    if not in_worker:
        assert torch.equal(torch.get_rng_state(), before[0])
        assert np.array_equal(np.random.get_state()[1], before[1])
        assert random.getstate() == before[2]
    assert torch.equal(first, dataset[(3, 42)])  # still a function of (index, seed)


def test_the_real_augmentation_follows_the_sample_seed():
    """syncseg.data.transforms.PairTransform seeds its albumentations pipeline from torch, which SeededDataset seeds:
    nothing reaches into the dataset to reseed it, so this fails if the transform stops drawing its seed."""
    from syncseg.data.transforms import build_train_transform
    from syncseg.engine.config import DataConfig

    transform = build_train_transform(DataConfig(crop_size=(24, 24), scale_range=(0.5, 2.0), hflip=True))
    image = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    mask = np.random.default_rng(1).integers(0, 5, (40, 40), dtype=np.uint8)

    class Augmented(Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            return transform(image, mask)

    dataset = SeededDataset(Augmented())
    first, again = dataset[(0, 7)], dataset[(0, 7)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    others = [dataset[(0, seed)] for seed in range(8, 12)]
    assert any(not torch.equal(first[0], other[0]) for other in others)


def test_seeded_loading_is_independent_of_worker_count():
    sampler = ResumableBatchSampler(10, global_batch=2, seed=5)
    results = []
    for workers in (0, 2):
        loader = DataLoader(SeededDataset(_RandomDataset()), batch_sampler=sampler, num_workers=workers)
        results.append(torch.cat(list(loader)))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


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


class _NumpyDraws(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor(np.random.random())


def test_worker_init_after_parent_used_cv2_threads_and_is_reproducible():
    # Regression: calling cv2.setNumThreads in a forked worker hangs once the parent has run cv2's
    # thread pool (as the training process does); the loader's timeout turns a hang into a failure.
    cv2.GaussianBlur(np.zeros((600, 800, 3), dtype=np.uint8), (0, 0), 4)

    def draws():
        loader = DataLoader(_NumpyDraws(), batch_size=1, num_workers=2, worker_init_fn=worker_init,
                            generator=torch.Generator().manual_seed(0), timeout=60)
        return [float(x) for x in loader]

    first = draws()
    assert first[0] != first[1]  # worker 0 and worker 1 draw from different numpy states
    assert first == draws()  # reproducible from the loader's generator
