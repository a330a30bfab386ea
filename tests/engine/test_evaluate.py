"""syncseg.engine.evaluate: the shared evaluation loop, single process and sharded over gloo processes."""
from __future__ import annotations

import gc
import json

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from syncseg.engine.config import DataConfig, EvalConfig
from syncseg.engine.evaluate import evaluate
from syncseg.engine.samplers import build_eval_loader
from tests.gloo import start_ranks

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
DATA = DataConfig(mean=MEAN, std=STD, ignore_index=255)
NUM_CLASSES = 4


class TinySeg(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, NUM_CLASSES, 3, padding=1)
        self.bn = nn.BatchNorm2d(NUM_CLASSES)

    def forward(self, x):
        return {"out": self.bn(self.conv(x))}


class MemoryDataset(Dataset):
    def __init__(self, count: int, size=(12, 14)):
        generator = torch.Generator().manual_seed(3)
        self.images = torch.randint(0, 256, (count, 3, *size), dtype=torch.uint8, generator=generator)
        self.masks = torch.randint(0, NUM_CLASSES, (count, *size), generator=generator)
        self.masks[:, :2] = 255

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], self.masks[index]


def _reference_metrics(model, dataset):
    """Independent path: float64 normalization, plain forward, torchmetrics."""
    from torchmetrics.classification import MulticlassJaccardIndex

    model64 = TinySeg().double().eval()
    model64.load_state_dict(model.state_dict())
    mean = torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    inputs = (dataset.images.double() / 255 - mean) / std
    with torch.no_grad():
        pred = model64(inputs)["out"].argmax(1)
    jaccard = MulticlassJaccardIndex(NUM_CLASSES, average="macro", ignore_index=255)
    return jaccard(pred, dataset.masks).item(), pred


def test_evaluate_matches_independent_reference_and_restores_mode():
    model = TinySeg()
    model.bn.running_mean.uniform_(-0.2, 0.2)
    model.train()
    dataset = MemoryDataset(5)
    seen = []
    results = evaluate(model, build_eval_loader(dataset, batch_size=2), num_classes=NUM_CLASSES, device="cpu",
                       data_cfg=DATA, eval_cfg=EvalConfig(), classes=("a", "b", "c", "d"), progress=False,
                       on_batch=lambda index, pred, masks: seen.append((index, pred, masks)))
    assert model.training  # restored for the training loop
    reference_miou, reference_pred = _reference_metrics(model, dataset)
    assert results["miou"] == pytest.approx(reference_miou, abs=1e-6)
    assert results["num_images"] == 5 and results["classes"] == ["a", "b", "c", "d"]
    assert [index for index, _, _ in seen] == [0, 1, 2]
    assert torch.equal(torch.cat([pred for _, pred, _ in seen]), reference_pred)
    json.dumps(results)  # plain types only


def test_evaluate_uses_eval_config_modes():
    model = TinySeg().eval()
    dataset = MemoryDataset(3, size=(20, 24))
    loader = build_eval_loader(dataset)
    kwargs = dict(num_classes=NUM_CLASSES, device="cpu", data_cfg=DATA, progress=False)
    whole = evaluate(model, loader, eval_cfg=EvalConfig(), **kwargs)
    big_window = evaluate(model, loader, eval_cfg=EvalConfig(mode="slide", window_size=64, stride=32), **kwargs)
    assert big_window["iou"] == whole["iou"]
    slide = evaluate(model, loader, eval_cfg=EvalConfig(mode="slide", window_size=10, stride=6), **kwargs)
    assert slide["num_images"] == 3 and slide["num_pixels"] == whole["num_pixels"]


def _ddp_worker(rank, world_size, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = TinySeg()
        ddp = nn.parallel.DistributedDataParallel(model)
        dataset = MemoryDataset(5)
        results = evaluate(ddp, build_eval_loader(dataset), num_classes=NUM_CLASSES, device="cpu",
                           data_cfg=DATA, eval_cfg=EvalConfig(), progress=False)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
        del ddp
        gc.collect()  # DDP sits in reference cycles: a live DDP during destroy_process_group aborts gloo at exit (syncseg.engine.distributed.cleanup)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_evaluation_equals_single_process(tmp_path):
    """5 images over 2 gloo processes (3 + 2): identical metrics, each image counted once."""
    start_ranks(_ddp_worker, (2, str(tmp_path / "init"), tmp_path), 2)
    single = evaluate(TinySeg(), build_eval_loader(MemoryDataset(5)), num_classes=NUM_CLASSES, device="cpu",
                      data_cfg=DATA, eval_cfg=EvalConfig(), progress=False)
    for rank in range(2):
        sharded = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sharded["num_images"] == 5
        assert sharded["num_pixels"] == single["num_pixels"]
        assert sharded["iou"] == pytest.approx(single["iou"], abs=1e-12)
        assert sharded["miou"] == pytest.approx(single["miou"], abs=1e-12)


def test_evaluate_skips_the_configured_ignore_label_not_a_fixed_one():
    """data.ignore_index reaches the confusion matrix (it once defaulted to 255 there)."""
    dataset = MemoryDataset(2)
    dataset.masks[dataset.masks == 255] = 3  # class 3 stands in for "unlabeled"
    loader = build_eval_loader(dataset)
    common = dict(num_classes=NUM_CLASSES, device="cpu", eval_cfg=EvalConfig(), progress=False)
    ignoring = evaluate(TinySeg().eval(), loader, data_cfg=DataConfig(mean=MEAN, std=STD, ignore_index=3), **common)
    counting = evaluate(TinySeg().eval(), loader, data_cfg=DATA, **common)
    assert ignoring["num_pixels"] == int((dataset.masks != 3).sum())
    assert counting["num_pixels"] == dataset.masks.numel()


def test_validation_autotunes_only_the_image_sizes_that_come_back(monkeypatch):
    """wrap_for_training turns cuDNN autotuning on for the process (the crops have one size), but
    whole-image validation of VOC or ADE20K feeds each image at its own size, and every new size was
    autotuned again. A size is autotuned only once it comes back; training gets its setting back after.
    The flag is a host setting: a model that records it during each forward stands in for cuDNN."""
    sizes = [(12, 14), (16, 10), (12, 14), (12, 14), (9, 9)]

    class Sized(Dataset):
        def __len__(self):
            return len(sizes)

        def __getitem__(self, index):
            height, width = sizes[index]
            return torch.zeros(3, height, width, dtype=torch.uint8), torch.zeros(height, width, dtype=torch.int64)

    class Recording(TinySeg):
        def forward(self, x):
            seen.append((tuple(x.shape[-2:]), torch.backends.cudnn.benchmark))
            return super().forward(x)

    seen = []
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)  # as wrap_for_training leaves it on CUDA
    loader = build_eval_loader(Sized(), batch_size=1, num_workers=0)
    evaluate(Recording(), loader, num_classes=NUM_CLASSES, device="cpu", data_cfg=DATA, eval_cfg=EvalConfig(),
             progress=False)
    assert seen == [((12, 14), False), ((16, 10), False), ((12, 14), True), ((12, 14), True), ((9, 9), False)]
    assert torch.backends.cudnn.benchmark is True  # training's setting, back
    seen.clear()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)  # eval.py: never turned on
    evaluate(Recording(), loader, num_classes=NUM_CLASSES, device="cpu", data_cfg=DATA, eval_cfg=EvalConfig(),
             progress=False)
    assert [benchmark for _, benchmark in seen] == [False] * len(sizes)
