"""The GPU step never waits for the host: host synchronizations counted on fake CUDA tensors.

Each test runs one piece of CUDA code under benchmarks/host_syncs.py's counter (no GPU needed: shapes only) and
asserts the number of blocking host-device copies and device reads it makes. The bars are 0: a new blocking
copy anywhere in the training step fails `test_a_training_step_makes_no_host_sync`.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks import host_syncs
from syncseg.data.transforms import normalize_batch
from syncseg.engine.config import DataConfig, ModelConfig, TrainConfig
from syncseg.engine.loss import build_loss
from syncseg.engine.precise_bn import recompute_batch_norm_statistics
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

DATA = DataConfig()


@pytest.fixture
def one_process_group():
    with host_syncs.one_process_group():
        yield


@pytest.fixture
def fake_cuda():
    with host_syncs.fake_cuda() as mode:
        yield mode  # entered by each test, after it has built its modules


def test_the_counter_sees_blocking_copies_and_reads(fake_cuda):
    """The counter itself: each kind of sync is seen, and the sync-free forms are not."""
    with fake_cuda, host_syncs.SyncCounter() as counter:
        values = torch.zeros(4, device="cuda")
        values[1:2] = 5.0  # a fill: free
        values.narrow(0, 2, 1).fill_(3.0)  # free
        assert not counter.events
        values[0] = 5.0  # a CPU scalar tensor copied in: a blocking copy
        torch.tensor([1.0, 2.0]).to("cuda")
        torch.tensor([1.0, 2.0]).to("cuda", non_blocking=True)  # asynchronous: free
        int(values.sum())
        values.cpu()
        values.to("cpu", non_blocking=True)  # into pinned memory, asynchronous: free
    assert [kind for kind, _ in counter.events] == ["host-to-device copy", "host-to-device copy", "read",
                                                    "device-to-host copy"]


@pytest.mark.parametrize("fused_backward", [True, False])
def test_a_synchronized_forward_and_backward_make_no_host_sync(fake_cuda, one_process_group, monkeypatch,
                                                                 fused_backward):
    from syncseg.model.sync_batchnorm import functions
    if not fused_backward:  # the two-pass input gradient (a device without torch's fused kernel)
        monkeypatch.setattr(functions, "uses_fused_kernels", lambda tensor: False)
    layer = SynchronizedBatchNorm2d(4)
    with fake_cuda:
        layer = layer.to("cuda")
        inputs = torch.randn(2, 4, 5, 5, device="cuda", requires_grad=True)
        with host_syncs.SyncCounter() as counter:
            for _ in range(2):  # the second call checks the first call's labels
                host_syncs.backward(layer(inputs).square().sum())
    assert counter.events == []
    assert inputs.grad is not None and layer.weight.grad is not None


def test_normalize_batch_makes_no_host_sync_once_its_constants_are_on_the_device(fake_cuda):
    with fake_cuda:
        images = torch.zeros(2, 3, 8, 8, dtype=torch.uint8, device="cuda")
        normalize_batch(images, DATA.mean, DATA.std)  # the first batch sends the constants
    with fake_cuda, host_syncs.SyncCounter() as counter:
        for _ in range(3):
            normalize_batch(images, DATA.mean, DATA.std)
    assert counter.events == []


def test_normalize_batch_caches_each_setting_apart():
    images = torch.full((1, 3, 1, 1), 255, dtype=torch.uint8)
    plain = normalize_batch(images, DATA.mean, DATA.std)
    other = normalize_batch(images, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    wide = normalize_batch(images.to(torch.int32).mul(257).to(torch.uint16), (0.0,) * 3, (1.0,) * 3,
                           max_value=65535)
    torch.testing.assert_close(other, torch.ones(1, 3, 1, 1))
    torch.testing.assert_close(wide, torch.ones(1, 3, 1, 1))
    expected = (1.0 - torch.tensor(DATA.mean, dtype=torch.float64)) / torch.tensor(DATA.std, dtype=torch.float64)
    torch.testing.assert_close(plain.view(3), expected.float())


@pytest.mark.parametrize("min_kept", [0, 30, 10_000])  # none, some, more than there are valid pixels
def test_ohem_loss_makes_no_host_sync(fake_cuda, min_kept):
    criterion = build_loss(TrainConfig(ohem=True, ohem_min_kept=min_kept), ignore_index=255)
    with fake_cuda:
        logits = torch.randn(2, 3, 9, 9, device="cuda", requires_grad=True)
        target = torch.zeros(2, 9, 9, dtype=torch.int64, device="cuda")
    with fake_cuda, host_syncs.SyncCounter() as counter:
        loss = criterion({"out": logits, "aux": logits * 2}, target)
        host_syncs.backward(loss)
    assert counter.events == []


def test_a_precise_bn_batch_makes_no_host_sync(fake_cuda, one_process_group):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), SynchronizedBatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 1), SynchronizedBatchNorm2d(4))
    with fake_cuda:
        model = model.to("cuda")
        normalize_batch(torch.zeros(1, 3, 4, 4, dtype=torch.uint8, device="cuda"), DATA.mean, DATA.std)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, generator=generator),
                torch.zeros(2, 8, 8, dtype=torch.int64)) for _ in range(2)]  # the loader's (CPU) batches
    with fake_cuda, host_syncs.SyncCounter() as counter:
        assert recompute_batch_norm_statistics(model, model, batches, data_cfg=DATA, precision="off",
                                               device=torch.device("cuda")) == 2
    assert counter.events == []


def test_a_training_step_makes_no_host_sync():
    """Trainer.train_step itself on DeepLabV3+ with synchronized BatchNorm, OHEM, fused SGD and EMA."""
    model_cfg = ModelConfig(arch="deeplabv3plus", backbone="resnet18", norm="syncbn", pretrained_backbone="none")
    train_cfg = TrainConfig(ohem=True, ohem_min_kept=50, ema_decay=0.99)
    events, loss, model = host_syncs.training_step_syncs(model_cfg, train_cfg, DATA, num_classes=3)
    assert events == []
    assert loss.device.type == "cuda" and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_only_replica_zero_reads_the_pending_label_checks():
    """DataParallel replicas share the list of pending checks; a replica other than copy 0 leaves it alone
    (two threads popping one list could check an entry twice or drop another's)."""
    layer = SynchronizedBatchNorm2d(2)
    checked = []
    layer._check_label_sums = lambda sums, group, own: checked.append(own)
    pending = [(torch.zeros(6, dtype=torch.float64), None, None, (1, 1, 0, 2))]
    layer._pending_label_checks = pending
    layer._is_parallel, layer._parallel_id = True, 1
    layer._check_pending_labels()
    assert checked == [] and len(pending) == 1
    layer._parallel_id = 0
    layer._check_pending_labels()
    assert checked == [(1, 1, 0, 2)] and pending == []


def test_a_confusion_update_on_the_device_makes_no_host_sync(fake_cuda):
    from syncseg.engine.confusion import ConfusionMatrix
    with fake_cuda:
        matrix = ConfusionMatrix(21, ignore_index=255, device="cuda")
        predictions = torch.zeros(2, 16, 16, dtype=torch.int64, device="cuda")
        masks = torch.zeros(2, 16, 16, dtype=torch.uint8, device="cuda")
        with host_syncs.SyncCounter() as counter:
            for _ in range(3):
                matrix.update(predictions, masks)
    assert counter.events == []
