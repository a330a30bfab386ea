"""A plain PyTorch evaluation loop, the baseline of bench_eval_vs_plain: model, DataLoader, confusion matrix.

Written the way torchvision's segmentation reference (references/segmentation/train.py, `evaluate` and
utils.ConfusionMatrix) evaluates: torchvision's own DeepLabV3 (`deeplabv3_resnet50`, built and then given
its weights with load_state_dict, as the reference resumes a checkpoint), model.eval() under
torch.inference_mode(), one whole image per batch, `model(image)["out"]` (torchvision upsamples it to the
input size), argmax, and the reference's matrix update: keep the target pixels in [0, C), bincount
C * target + prediction. float32, the default memory layout, the allocator the process was started with.
The model is built without the auxiliary head (`aux_loss=False`): torchvision computes the aux output in
eval mode too, which a loop that only reads "out" should not pay for, so the baseline does the same network
work as eval.py. It reads the same images as eval.py: the config's data section through syncseg's dataset
builder (evaluation transform: whole images, uint8), normalized on the fly.

    python -m benchmarks.plain_eval --config CONFIG.yaml --split val --weights TORCHVISION_STATE.pt --output RESULT.json

Writes {"images": N, "loop_seconds": s, "miou": m} (loop_seconds: the loop alone, start-up excluded).
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a YAML whose data section names the dataset")
    parser.add_argument("--split", required=True)
    parser.add_argument("--weights", required=True, help="a state dict of torchvision's deeplabv3_resnet50 "
                        "(no aux head) with one output per class of the dataset")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    import torch
    from torch.utils.data import DataLoader
    from torchvision.models.segmentation import deeplabv3_resnet50

    from syncseg.data.registry import build_dataset
    from syncseg.engine.config import load_config

    data = load_config(args.config, []).data
    dataset = build_dataset(data, args.split, train=False)
    classes = len(dataset.classes)
    loader = DataLoader(dataset, batch_size=1, shuffle=False, num_workers=data.num_workers)
    model = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=classes, aux_loss=False)
    model.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
    model.eval()
    mean = torch.tensor(data.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.std).view(1, -1, 1, 1)
    matrix = torch.zeros(classes, classes, dtype=torch.int64)

    start = time.perf_counter()
    with torch.inference_mode():
        for images, targets in loader:
            output = model((images.float() / 255 - mean) / std)["out"]
            predictions = output.argmax(1).flatten()
            targets = targets.flatten()
            keep = (targets >= 0) & (targets < classes)
            matrix += torch.bincount(classes * targets[keep] + predictions[keep],
                                     minlength=classes ** 2).reshape(classes, classes)
    loop_seconds = time.perf_counter() - start
    matrix = matrix.double()
    union = matrix.sum(0) + matrix.sum(1) - matrix.diag()
    present = union > 0
    miou = float((matrix.diag()[present] / union[present]).mean()) if bool(present.any()) else 0.0
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump({"images": len(dataset), "loop_seconds": loop_seconds, "miou": miou}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
