"""Host synchronizations per training step: how often a GPU step would make the host wait for the device.

No timing and no GPU: one `Trainer.train_step` of the config's model, loss, optimizer and EMA runs on fake
CUDA tensors (benchmarks/host_syncs.py: shapes only, counted through PyTorch's dispatch), and every blocking
host-device copy and every read of a device value (`.item()`, `int(t)`, ...) is counted. Each one drains
the CUDA stream, so the host cannot queue the next kernels while the GPU works. Two paths: "synchronized"
(the synchronized BatchNorm layers reduce over a process group, as with several GPUs; counted over a
1-process gloo group) and "one process" (the layers' single-device path). Target: 0 per step on both.
Counted in fp32: autocast and GradScaler switch themselves off without a CUDA runtime (bf16 adds casts and
no syncs; fp16's GradScaler reads its inf flag once per step, as torch designs it).

    python -m benchmarks.bench_host_syncs [--config demo.yaml] [--image-size 64] [KEY=VALUE ...]
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import sys

from benchmarks.common import config_parser, environment, judge, print_targets, write_record


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("bench_host_syncs", __doc__)
    parser.add_argument("--image-size", type=int, default=64, help="side of the fake batch's images (shapes only)")
    parser.add_argument("--batch-size", type=int, default=2, help="images in the fake batch")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from benchmarks.host_syncs import training_step_syncs
    from syncseg.engine.config import load_config

    config = load_config(args.config, args.overrides)
    model_cfg = dataclasses.replace(config.model, pretrained_backbone="none")  # weights change no sync
    num_classes = 6  # the step's syncs do not depend on the class count
    print(f"host synchronizations per training step, config {args.config} {' '.join(args.overrides)}: "
          f"{config.model.arch} / {config.model.backbone}, norm {config.model.norm}, loss {' + '.join(f'{w:g} {t}' for t, w in config.train.loss)}, "
          f"ohem {config.train.ohem}, optimizer {config.train.optimizer}, ema {config.train.ema_decay:g}, "
          f"{args.batch_size} x {args.image_size} px, fp32 on fake CUDA")
    print(f"{'path':<13} {'host-to-device copies':>22} {'device-to-host copies':>22} {'device reads':>13} {'total':>6}")
    paths, targets = {}, []
    for name, synchronized in (("synchronized", True), ("one process", False)):
        events, _, _ = training_step_syncs(model_cfg, config.train, config.data, num_classes=num_classes,
                                           image_size=args.image_size, batch_size=args.batch_size,
                                           synchronized=synchronized)
        kinds = collections.Counter(kind for kind, _ in events)
        print(f"{name:<13} {kinds['host-to-device copy']:22d} {kinds['device-to-host copy']:22d} "
              f"{kinds['read']:13d} {len(events):6d}")
        for kind, op in sorted(set(events)):
            print(f"    {kind}: {op} x{events.count((kind, op))}")
        paths[name] = {"total": len(events), "kinds": dict(kinds), "events": [list(event) for event in events]}
        targets.append(judge(f"host syncs per training step ({name})", {"median": float(len(events))},
                             target=0, control=None, unit=""))
    print_targets(targets)
    write_record("bench_host_syncs", args.output, {
        "environment": environment(), "config": args.config, "overrides": args.overrides,
        "image_size": args.image_size, "batch_size": args.batch_size, "paths": paths, "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
