"""syncseg.engine.confusion.ConfusionMatrix against torchmetrics, cityscapesscripts and float64 recomputation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from syncseg.data.transforms import IGNORE_INDEX
from syncseg.engine.confusion import ConfusionMatrix


def _voc_like(seed: int, *, num_classes: int = 21, shape=(3, 37, 41)) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets with 255 pixels, class 5 absent from truth and prediction, class 6 only predicted,
    class 7 only in the truth; predictions right ~60% of the time."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, num_classes, shape, generator=generator)
    target[target == 5] = 0
    target[target == 6] = 1
    target[torch.rand(shape, generator=generator) < 0.15] = 255
    noise = torch.randint(0, num_classes, shape, generator=generator)
    pred = torch.where(torch.rand(shape, generator=generator) < 0.6, target.clamp(max=num_classes - 1), noise)
    pred[pred == 5] = 4
    pred[pred == 7] = 8 if num_classes > 8 else 0
    return pred, target


def _reference_matrix(pred: np.ndarray, target: np.ndarray, num_classes: int, ignore: int) -> np.ndarray:
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    for t, p in zip(target.ravel().tolist(), pred.ravel().tolist()):
        if t != ignore:
            matrix[t, p] += 1
    return matrix


def test_matches_torchmetrics_jaccard_and_confusion():
    from torchmetrics.classification import MulticlassConfusionMatrix, MulticlassJaccardIndex

    num_classes = 21
    pred, target = _voc_like(0, num_classes=num_classes)
    ours = ConfusionMatrix(num_classes, ignore_index=IGNORE_INDEX)
    ours.update(pred[:2], target[:2])
    ours.update(pred[2:], target[2:])
    metrics = ours.compute()

    confusion = MulticlassConfusionMatrix(num_classes, ignore_index=255)(pred, target)
    assert torch.equal(ours.matrix, confusion)
    per_class = MulticlassJaccardIndex(num_classes, average="none", ignore_index=255)(pred, target).double()
    macro = MulticlassJaccardIndex(num_classes, average="macro", ignore_index=255)(pred, target).item()
    union = confusion.sum(0) + confusion.sum(1) - confusion.diagonal()
    for index in range(num_classes):
        if union[index] == 0:
            assert metrics["iou"][index] is None
        else:
            assert metrics["iou"][index] == pytest.approx(per_class[index].item(), abs=1e-6)
    assert metrics["iou"][5] is None and metrics["iou"][6] == 0.0 and metrics["iou"][7] == 0.0
    assert metrics["miou"] == pytest.approx(macro, abs=1e-6)


def test_accuracies_match_torchmetrics_when_every_class_is_in_the_truth():
    from torchmetrics.classification import MulticlassAccuracy

    generator = torch.Generator().manual_seed(1)
    num_classes = 6
    target = torch.randint(0, num_classes, (2, 30, 30), generator=generator)
    pred = torch.where(torch.rand(target.shape, generator=generator) < 0.7, target,
                       torch.randint(0, num_classes, target.shape, generator=generator))
    target[:, :3] = 255
    matrix = ConfusionMatrix(num_classes, ignore_index=IGNORE_INDEX)
    matrix.update(pred, target)
    metrics = matrix.compute()
    micro = MulticlassAccuracy(num_classes, average="micro", ignore_index=255)(pred, target).item()
    macro = MulticlassAccuracy(num_classes, average="macro", ignore_index=255)(pred, target).item()
    assert metrics["pixel_acc"] == pytest.approx(micro, abs=1e-6)
    assert metrics["mean_acc"] == pytest.approx(macro, abs=1e-6)


def test_all_metrics_against_float64_recomputation():
    num_classes = 9
    pred, target = _voc_like(2, num_classes=num_classes, shape=(2, 19, 23))
    matrix = ConfusionMatrix(num_classes, ignore_index=IGNORE_INDEX)
    matrix.update(pred, target)
    metrics = matrix.compute()
    ref = _reference_matrix(pred.numpy(), target.numpy(), num_classes, 255).astype(np.float64)
    assert np.array_equal(matrix.matrix.numpy(), ref.astype(np.int64))
    total = ref.sum()
    iou, acc, fw = [], [], 0.0
    for c in range(num_classes):
        tp, gt, pr = ref[c, c], ref[c].sum(), ref[:, c].sum()
        iou.append(tp / (gt + pr - tp) if gt + pr - tp else None)
        acc.append(tp / gt if gt else None)
        if gt:
            fw += gt / total * iou[-1]
    for ours, expected in zip(metrics["iou"], iou):
        assert (ours is None and expected is None) or ours == pytest.approx(expected, abs=1e-12)
    assert metrics["miou"] == pytest.approx(np.mean([v for v in iou if v is not None]), abs=1e-12)
    assert metrics["mean_acc"] == pytest.approx(np.mean([v for v in acc if v is not None]), abs=1e-12)
    assert metrics["pixel_acc"] == pytest.approx(np.trace(ref) / total, abs=1e-12)
    assert metrics["fwiou"] == pytest.approx(fw, abs=1e-12)
    assert metrics["num_pixels"] == int(total)


@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32, torch.uint8])
def test_dtypes_give_the_same_matrix(target_dtype):
    pred, target = _voc_like(3)
    reference = _reference_matrix(pred.numpy(), target.numpy(), 21, 255)
    matrix = ConfusionMatrix(21, ignore_index=IGNORE_INDEX)
    matrix.update(pred.to(torch.int32 if target_dtype != torch.int64 else torch.int64), target.to(target_dtype))
    assert np.array_equal(matrix.matrix.numpy(), reference)


@pytest.mark.parametrize("ignore_index", [-1, 0, 300])
def test_other_ignore_indices(ignore_index):
    pred, target = _voc_like(4, num_classes=8, shape=(2, 17, 13))
    target = torch.where(target == 255, torch.full_like(target, ignore_index), target)
    matrix = ConfusionMatrix(8, ignore_index=ignore_index)
    matrix.update(pred, target)
    reference = _reference_matrix(pred.numpy(), target.numpy(), 8, ignore_index)
    assert np.array_equal(matrix.matrix.numpy(), reference)


@pytest.mark.parametrize("target_dtype", [torch.int64, torch.uint8])
def test_many_classes_use_wide_indices(target_dtype):
    generator = torch.Generator().manual_seed(5)
    target = torch.randint(0, 150, (2, 40, 40), generator=generator)
    target[:, :4] = 255
    pred = torch.randint(0, 150, target.shape, generator=generator)
    matrix = ConfusionMatrix(150, ignore_index=IGNORE_INDEX)
    matrix.update(pred, target.to(target_dtype))  # 256 x 150 bins: past int16 whatever the target's dtype
    assert np.array_equal(matrix.matrix.numpy(), _reference_matrix(pred.numpy(), target.numpy(), 150, 255))


def test_strided_and_offset_inputs_count_their_own_values():
    """The int64 inputs are read through their low words: a transposed or sliced tensor must still be
    counted by value, not by its storage."""
    pred, target = _voc_like(6, shape=(3, 37, 41))
    reference = _reference_matrix(pred[:, 1:].transpose(1, 2).numpy(), target[:, 1:].transpose(1, 2).numpy(), 21, 255)
    matrix = ConfusionMatrix(21, ignore_index=IGNORE_INDEX)
    matrix.update(pred[:, 1:].transpose(1, 2), target[:, 1:].transpose(1, 2))
    assert np.array_equal(matrix.matrix.numpy(), reference)
    for part in (slice(7, None), slice(3, None, 2)):  # a view that starts mid-storage; a strided flat view
        flat = ConfusionMatrix(21, ignore_index=IGNORE_INDEX)
        flat.update(pred.reshape(-1)[part], target.reshape(-1)[part])
        assert np.array_equal(flat.matrix.numpy(), _reference_matrix(pred.reshape(-1)[part].numpy(),
                                                                     target.reshape(-1)[part].numpy(), 21, 255))


def test_values_whose_low_word_is_a_class_are_still_out_of_range():
    """2**32 + 3 has the low 32 bits of class 3: the range checks read whole values, so it is refused."""
    matrix = ConfusionMatrix(4, ignore_index=IGNORE_INDEX)
    good = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="predictions"):
        matrix.update(torch.tensor([[0, 1, 2**32 + 3], [0, 0, 0]]), good)
    with pytest.raises(ValueError, match="outside"):
        matrix.update(good, torch.tensor([[0, 1, 2**32 + 3], [255, 2, 3]]))
    with pytest.raises(ValueError, match="outside"):
        matrix.update(good, torch.tensor([[0, 1, 2**32 + 255], [255, 2, 3]]))  # nor the ignore label's
    assert int(matrix.matrix.sum()) == 0


def test_bad_inputs_raise():
    matrix = ConfusionMatrix(4, ignore_index=IGNORE_INDEX)
    good = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="shape"):
        matrix.update(good, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="outside"):
        matrix.update(good, torch.tensor([[0, 1, 4], [255, 2, 3]]))
    with pytest.raises(ValueError, match="outside"):
        matrix.update(good, torch.tensor([[0, -3, 1], [255, 2, 3]]))
    with pytest.raises(ValueError, match="predictions"):
        matrix.update(torch.tensor([[0, 1, 4], [0, 0, 0]]), good)
    with pytest.raises(ValueError, match="integer"):
        matrix.update(good.float(), good)
    assert int(matrix.matrix.sum()) == 0  # nothing half-counted by the failed updates
    empty = ConfusionMatrix(3, ignore_index=IGNORE_INDEX).compute()
    assert math.isnan(empty["miou"]) and empty["iou"] == [None, None, None]


def test_cityscapes_parity_with_cityscapesscripts(tmp_path):
    """Per-class IoU and mIoU equal the official pixel-level evaluation on a Cityscapes-layout set."""
    pytest.importorskip("cityscapesscripts")
    from cityscapesscripts.evaluation import evalPixelLevelSemanticLabeling as official
    from cityscapesscripts.helpers.labels import labels

    train_to_label = {l.trainId: l.id for l in labels if 0 <= l.trainId < 255}
    ignored_label_ids = [l.id for l in labels if l.ignoreInEval and l.id >= 0]
    label_to_train = np.full(256, 255, dtype=np.int64)
    for l in labels:
        if l.id >= 0 and 0 <= l.trainId < 255:
            label_to_train[l.id] = l.trainId

    rng = np.random.default_rng(0)
    ours = ConfusionMatrix(19, ignore_index=IGNORE_INDEX)
    gt_files, pred_files = [], []
    for index, city in enumerate(["aachen", "bremen", "aachen"]):
        stem = f"{city}_{index:06d}_000019"
        gt_train = rng.integers(0, 19, size=(24, 48))
        gt_train[gt_train == 16] = 15  # "train" absent from truth and prediction -> n/a on both sides
        gt_train[gt_train == 17] = 14  # "motorcycle" only predicted -> IoU 0
        pred_train = np.where(rng.random(gt_train.shape) < 0.55, gt_train, rng.integers(0, 19, gt_train.shape))
        pred_train[pred_train == 16] = 3
        gt_train[rng.random(gt_train.shape) < 0.2] = 255
        gt_ids = np.vectorize(lambda t: train_to_label.get(int(t), 0))(gt_train)
        ignored = gt_train == 255
        gt_ids[ignored] = rng.choice(ignored_label_ids, size=int(ignored.sum()))
        pred_ids = np.vectorize(lambda t: train_to_label[int(t)])(pred_train)
        gt_dir = tmp_path / "gtFine" / "val" / city
        gt_dir.mkdir(parents=True, exist_ok=True)
        (tmp_path / "results").mkdir(exist_ok=True)
        gt_file = gt_dir / f"{stem}_gtFine_labelIds.png"
        pred_file = tmp_path / "results" / f"{stem}_leftImg8bit.png"
        Image.fromarray(gt_ids.astype(np.uint8)).save(gt_file)
        Image.fromarray(pred_ids.astype(np.uint8)).save(pred_file)
        gt_files.append(str(gt_file))
        pred_files.append(str(pred_file))
        # Our side reads the same PNGs back, mapping labelIds to trainIds.
        gt_back = label_to_train[np.array(Image.open(gt_file))]
        pred_back = label_to_train[np.array(Image.open(pred_file))]
        ours.update(torch.from_numpy(pred_back), torch.from_numpy(gt_back))

    args = official.args
    args.cityscapesPath = str(tmp_path)
    args.predictionPath = str(tmp_path / "results")
    args.predictionWalk = None
    args.exportFile = str(tmp_path / "result.json")
    args.evalInstLevelScore = False
    args.evalPixelAccuracy = False
    args.JSONOutput = False
    args.quiet = True
    assert [official.getPrediction(args, gt) for gt in gt_files] == pred_files  # the official pairing
    result = official.evaluateImgLists(pred_files, gt_files, args)

    metrics = ours.compute()
    train_names = {l.trainId: l.name for l in labels if 0 <= l.trainId < 255}
    for train_id in range(19):
        official_iou = result["classScores"][train_names[train_id]]
        if math.isnan(official_iou):
            assert metrics["iou"][train_id] is None, train_names[train_id]
        else:
            assert metrics["iou"][train_id] == pytest.approx(official_iou, abs=1e-12), train_names[train_id]
    assert metrics["iou"][16] is None and metrics["iou"][17] == 0.0
    assert metrics["miou"] == pytest.approx(result["averageScoreClasses"], abs=1e-12)


@pytest.mark.parametrize("ignore_index", [255, 0, -1, 4])
@pytest.mark.parametrize("target_dtype", [torch.uint8, torch.int64])
def test_the_device_path_counts_what_the_host_path_counts(ignore_index, target_dtype):
    """update() on an accelerator reads nothing back (tests/engine/test_host_syncs.py); run here on CPU
    tensors, it gives the host path's matrix, ignore indices inside, below and past the classes included."""
    generator = torch.Generator().manual_seed(7)
    pred = torch.randint(0, 5, (3, 11, 13), generator=generator)
    target = torch.randint(0, 5, (3, 11, 13), generator=generator)
    if ignore_index != 4:
        target[torch.rand(target.shape, generator=generator) < 0.2] = ignore_index if ignore_index >= 0 else 0
    if target_dtype == torch.uint8 and ignore_index < 0:
        pytest.skip("a uint8 mask holds no negative ignore index")
    if ignore_index < 0:
        target[0, 0, :3] = ignore_index
    target = target.to(target_dtype)
    host, device = ConfusionMatrix(5, ignore_index=ignore_index), ConfusionMatrix(5, ignore_index=ignore_index)
    host.update(pred, target)
    device._update_without_reads(pred.reshape(-1), target.reshape(-1))
    assert torch.equal(host.matrix, device.matrix) and host.matrix.sum() > 0
    assert device.compute() == host.compute()


def test_the_device_path_raises_out_of_range_values_at_compute():
    matrix = ConfusionMatrix(4, ignore_index=IGNORE_INDEX)
    pred, target = torch.tensor([0, 1, 4, 2]), torch.tensor([0, 7, 1, IGNORE_INDEX])
    matrix._update_without_reads(pred, target)
    assert matrix.matrix.sum() == 1  # only the first pixel is counted
    with pytest.raises(ValueError, match=r"1 predicted pixel\(s\) outside \[0, 4\) and 1 target pixel"):
        matrix.compute()
    matrix.reset()
    assert matrix.compute()["num_pixels"] == 0
