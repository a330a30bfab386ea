"""A plain PyTorch training loop, the baseline of bench_vs_plain: model, loss, optimizer, DataLoader, nothing else.

Written the way torchvision's segmentation reference (references/segmentation/train.py) trains: torchvision's
own DeepLabV3 (`deeplabv3_resnet50`, aux head), cross-entropy on the output plus 0.5 x on the auxiliary
output, SGD with momentum and a polynomial learning rate, a shuffling DataLoader, float32, the default
memory layout, the allocator the process was started with. It reads the same data as the product: the data
section of the config bench_vs_plain gives train.py, through syncseg's dataset builder (same files or
synthetic renders, same augmentation), normalized on the fly like the product.

    python -m benchmarks.plain_loop --config CONFIG.yaml --iters 18 --window 6 --output RESULT.json

Writes {"images_per_s": [one value per window of `--window` iterations], ...}; each window's time runs from
the end of the previous window's last step to the end of its own (data waits included), as the product's
metrics.jsonl measures images_per_s.
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the YAML bench_vs_plain hands train.py (its data section)")
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--window", type=int, required=True, help="iterations per timing window")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torchvision.models.segmentation import deeplabv3_resnet50

    from syncseg.data.registry import build_dataset
    from syncseg.engine.config import load_config

    config = load_config(args.config, [])
    data, train = config.data, config.train
    torch.manual_seed(0)
    dataset = build_dataset(data, data.train_split, train=True)
    loader = DataLoader(dataset, batch_size=train.batch_size, shuffle=True, num_workers=data.num_workers,
                        drop_last=True, persistent_workers=data.num_workers > 0)
    model = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=data.num_classes, aux_loss=True)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=train.lr, momentum=train.momentum,
                                weight_decay=train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (1 - step / args.iters) ** 0.9)
    mean = torch.tensor(data.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.std).view(1, -1, 1, 1)

    rates, losses, iteration = [], [], 0
    window_start = time.perf_counter()
    while iteration < args.iters:
        for images, masks in loader:
            inputs = (images.float() / 255 - mean) / std
            output = model(inputs)
            loss = (F.cross_entropy(output["out"], masks, ignore_index=data.ignore_index)
                    + 0.5 * F.cross_entropy(output["aux"], masks, ignore_index=data.ignore_index))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            iteration += 1
            if iteration % args.window == 0:
                now = time.perf_counter()
                rates.append(args.window * train.batch_size / (now - window_start))
                window_start = now
            if iteration >= args.iters:
                break
    parameters = sum(p.numel() for p in model.parameters())
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump({"images_per_s": rates, "losses": losses, "parameters": parameters}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
