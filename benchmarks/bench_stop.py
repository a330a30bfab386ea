"""Cost of the per-step stop agreement (syncseg.engine.signals.StopRequest.agreed) in a training loop.

Two processes on loopback (gloo, one torch thread each, so each has a core) build the config's Trainer
(DDP) and a few batches loaded beforehand. Three variants run interleaved in rounds (a balanced order, the
same on both processes): `--steps` calls of `Trainer.train_step` each followed by `agreed()` as the loop
calls it ("agree"), the same steps without it ("plain"), and "plain" again as the A/A control. Timing the
agreement alone would count the wait for the slower process, which the next step's gradient all-reduce
waits for anyway; the loop's time with and without it is the cost. Target: median paired ratio
agree / plain <= 1.01. Rank 0 prints the table and writes the JSON.

    python -m benchmarks.bench_stop [--config demo.yaml] [--rounds 24] [--steps 3] [KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.common import balanced_orders, config_parser, environment, judge, paired, print_targets, stable_allocator
from benchmarks.common import summary, write_record


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import logging

    import torch

    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import cleanup, setup_distributed
    from syncseg.engine.samplers import train_steps
    from syncseg.engine.signals import StopRequest
    from syncseg.engine.trainer import Trainer

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    info = setup_distributed(None)
    config = load_config(args.config, [f"output_dir={args.run_dir}", *args.overrides])
    trainer = Trainer.from_config(config, info, progress=False)
    steps = train_steps(trainer.parts.train_loader, 0)
    batches = [next(steps) for _ in range(4)]
    steps.close()
    seconds: dict[str, list[float]] = {"agree": [], "plain": [], "plain_again": []}
    orders = balanced_orders(list(seconds))
    with StopRequest() as stop:
        for round_index in range(args.warmup + args.rounds):
            for name in orders[round_index % len(orders)]:
                start = time.perf_counter()
                for index in range(args.steps):
                    trainer.train_step(batches[index % len(batches)])
                    if name == "agree" and stop.agreed():
                        raise RuntimeError("no stop was requested, yet the processes agreed to stop")
                if round_index >= args.warmup:
                    seconds[name].append(time.perf_counter() - start)
    trainer.close()
    cleanup()
    if rank != 0:
        return
    ratio, control = paired(seconds["agree"], seconds["plain"]), paired(seconds["plain_again"], seconds["plain"])
    step_ms = summary(seconds["plain"], scale=1e3 / args.steps)
    print(f"stop agreement after each step, 2 gloo processes, config {args.config} {' '.join(args.overrides)}")
    print(f"  step without agreement  median {step_ms['median']:9.2f} ms ({args.rounds} rounds of {args.steps})")
    print(f"  agree / plain           median {ratio['median']:.4f} (IQR {ratio['q1']:.4f}-{ratio['q3']:.4f})")
    print(f"  plain again / plain     median {control['median']:.4f} (A/A control)")
    targets = [judge("step with the stop agreement / without", ratio, target=1.01, control=control)]
    print_targets(targets)
    write_record("bench_stop", args.output, {
        "environment": environment(processes=2), "config": args.config, "overrides": args.overrides,
        "step_ms": step_ms, "ratio": ratio, "control": control, "targets": targets,
    })


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("bench_stop", __doc__)
    parser.add_argument("--rounds", type=int, default=24, help="timed rounds (each variant once a round)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per variant and round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    args = parser.parse_intermixed_args(argv)
    stable_allocator("benchmarks.bench_stop", sys.argv[1:] if argv is None else argv)

    import tempfile

    import torch.multiprocessing as mp

    from tests.gloo import free_port

    with tempfile.TemporaryDirectory() as run_dir:
        args.run_dir = run_dir
        mp.spawn(_worker, args=(args, free_port()), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
