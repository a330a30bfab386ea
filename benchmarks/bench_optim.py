"""Cost of one optimizer step: the fused kernels syncseg.engine.optim.build_optimizer picks against torch's
default on a CPU (a loop over the parameters, one tensor at a time).

The config's model (its parameters as the trainer groups them, random gradients) and two optimizers per
kind over copies of them: "fused" (build_optimizer's choice on this device) and "loop" (the same settings,
fused=False, foreach=False). Variants run interleaved (benchmarks.common.time_interleaved, a balanced order)
with "fused again" as the A/A control. Target: median paired ratio fused / loop <= 0.5 for the configured
optimizer, reported for the other kind as well.

    python -m benchmarks.bench_optim [--config demo.yaml] [--repeats 40] [--threads 0] [KEY=VALUE ...]
"""
from __future__ import annotations

import logging
import sys

from benchmarks.common import config_parser, environment, judge, paired, print_targets, stable_allocator, summary
from benchmarks.common import time_interleaved, write_record


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("bench_optim", __doc__)
    parser.add_argument("--repeats", type=int, default=40, help="timed samples of each variant")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave as is)")
    args = parser.parse_intermixed_args(argv)
    stable_allocator("benchmarks.bench_optim", sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)

    import copy
    import dataclasses

    import torch

    from syncseg.engine.config import load_config
    from syncseg.engine.optim import build_optimizer, build_param_groups
    from syncseg.model.builder import build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config, args.overrides)
    torch.manual_seed(0)
    model = build_model(config.model, 6)  # the demo's class count; the step's cost hardly depends on it
    records, targets = {}, []
    print(f"optimizer step, config {args.config} {' '.join(args.overrides)}: "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {torch.get_num_threads()} threads")
    kinds = [config.train.optimizer] + [kind for kind in ("adamw", "sgd") if kind != config.train.optimizer]
    for kind in kinds:
        train_cfg = dataclasses.replace(config.train, optimizer=kind)
        optimizers = {}
        for name in ("fused", "loop", "fused_again"):
            replica = copy.deepcopy(model)
            for parameter in replica.parameters():
                parameter.grad = torch.randn_like(parameter)
            groups = build_param_groups(replica, lr=train_cfg.lr, head_lr_mult=train_cfg.head_lr_mult,
                                        weight_decay=train_cfg.weight_decay)
            optimizer = build_optimizer(groups, train_cfg)
            if name == "loop":
                for group in optimizer.param_groups:
                    group["fused"], group["foreach"] = False, False
            optimizers[name] = optimizer
        seconds = time_interleaved({name: optimizer.step for name, optimizer in optimizers.items()}, args.repeats,
                                   warmup=2)
        ratio, control = paired(seconds["fused"], seconds["loop"]), paired(seconds["fused_again"], seconds["fused"])
        fused_ms, loop_ms = summary(seconds["fused"], scale=1e3), summary(seconds["loop"], scale=1e3)
        print(f"  {kind:5s}  fused {fused_ms['median']:7.2f} ms  loop {loop_ms['median']:7.2f} ms  "
              f"fused / loop {ratio['median']:.3f} (IQR {ratio['q1']:.3f}-{ratio['q3']:.3f})  "
              f"A/A {control['median']:.3f}")
        records[kind] = {"fused_ms": fused_ms, "loop_ms": loop_ms, "ratio": ratio, "control": control}
        targets.append(judge(f"{kind} step fused / per-tensor loop", ratio, target=0.5, control=control))
    if targets:
        print_targets(targets)
    write_record("bench_optim", args.output, {
        "environment": environment(), "config": args.config, "overrides": args.overrides, "kinds": records,
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
