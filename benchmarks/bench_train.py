"""Overhead of the training loop: full `Trainer.fit` vs a bare forward + backward + optimizer step.

Both run in one process on the same model, interleaved in rounds: a round trains `--iters` iterations
with the full loop (data loading through the DataLoader and its workers, loss, AMP, LR schedule, loss
flushing, TensorBoard + metrics.jsonl logging), then the same number of bare steps on batches loaded
beforehand (normalize, forward, cross-entropy, backward, step; no data loading, no logging), then
`Trainer.train_step` on those batches (the engine's step without the input pipeline). Validation and
checkpoints are outside the timed window (the full loop's time is `TrainResult.train_seconds`).
Reports per-round seconds per iteration, the paired ratio full / bare per round and their medians;
target ratio <= 1.10. Public API only.

    python -m benchmarks.bench_train [--config demo.yaml] [--rounds 64] [--iters 3] [--threads 1] [KEY=VALUE ...]

Defaults: one torch thread, so the DataLoader worker has the other core (as workers have their own cores
in a real run) instead of stealing one of the two compute threads' cores, which made identical rounds
differ by ~11%; with one thread they differ by ~7%. Short rounds (3 iterations) and many of them: the
median of paired ratios sheds the rounds a burst of machine noise hits, and 15-iteration rounds all
contained some.
"""
from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time

from benchmarks.common import balanced_orders, config_parser, environment, judge, paired, print_targets, quiet_gc
from benchmarks.common import stable_allocator, write_record


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("bench_train", __doc__)
    parser.add_argument("--rounds", type=int, default=64,
                        help="interleaved rounds of the four variants (4 make one balanced cycle)")
    parser.add_argument("--iters", type=int, default=3, help="iterations per round and variant")
    parser.add_argument("--warmup", type=int, default=-1,
                        help="untimed full-loop iterations first (-1: one epoch, so the timed rounds see the "
                             "steady state of a run, e.g. the synthetic renders already cached by the workers)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0 = leave as is)")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import torch
    import torch.nn.functional as F

    from syncseg.data.transforms import normalize_batch
    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import setup_distributed
    from syncseg.engine.devices import autocast_for
    from syncseg.engine.samplers import train_batches
    from syncseg.engine.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    never = 10**7  # iterations: the schedule's length does not change the cost of an iteration
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(args.config, [
            f"output_dir={run_dir}", f"train.iters={never}", f"train.val_interval={never}",
            f"train.ckpt_interval={never}", *args.overrides,
        ])
        dist_info = setup_distributed(None)
        trainer = Trainer.from_config(config, dist_info, progress=False)
        if args.warmup < 0:
            args.warmup = len(trainer.parts.train_loader)
        device, data_cfg = trainer.device, config.data
        # the bare loop's batches: loaded up front, outside any timing
        bare_batches = [batch for _, batch in zip(range(args.iters), train_batches(trainer.parts.train_loader, 0))]
        trainer.fit(stop_at=args.warmup)

        def bare_steps() -> None:
            for images, masks in bare_batches:
                # the training loader's masks are uint8 until the device (build_dataset's compact_masks): widened
                # there, as Trainer.train_step does
                images, masks = images.to(device), masks.to(device).long()
                inputs = normalize_batch(images, data_cfg.mean, data_cfg.std)
                if trainer.model.channels_last:  # as the trainer resolved model.channels_last
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                with autocast_for(device, config.train.amp):
                    logits = trainer.parts.train_model(inputs)["out"]
                loss = F.cross_entropy(logits.float(), masks, ignore_index=config.data.ignore_index)
                trainer.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                trainer.optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def engine_steps() -> None:
            for images, masks in bare_batches:
                trainer.train_step([(images, masks)])  # one micro-batch (train.accumulate=1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def full_loop() -> float:
            result = trainer.fit(stop_at=trainer.iteration + args.iters)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return result.train_seconds  # the loop without the checkpoint at its stop

        def timed(steps) -> float:
            start = time.perf_counter()
            steps()
            return time.perf_counter() - start

        variants = {"full": full_loop, "bare": lambda: timed(bare_steps), "step": lambda: timed(engine_steps),
                    "bare_copy": lambda: timed(bare_steps)}
        rows = []
        orders = balanced_orders(list(variants))
        for round_index in range(args.rounds):
            order = orders[round_index % len(orders)]
            seconds = {}
            for name in order:
                with quiet_gc():
                    seconds[name] = variants[name]() / args.iters
            rows.append({"round": round_index, "full_s_per_iter": seconds["full"], "bare_s_per_iter": seconds["bare"],
                         "bare_copy_s_per_iter": seconds["bare_copy"], "train_step_s_per_iter": seconds["step"],
                         "ratio": seconds["full"] / seconds["bare"], "train_step_ratio": seconds["step"] / seconds["bare"]})
        trainer.close()

    full_median = statistics.median(r["full_s_per_iter"] for r in rows)
    bare_median = statistics.median(r["bare_s_per_iter"] for r in rows)
    ratio_median = statistics.median(r["ratio"] for r in rows)
    step_median = statistics.median(r["train_step_s_per_iter"] for r in rows)
    step_ratio_median = statistics.median(r["train_step_ratio"] for r in rows)
    print(f"config {args.config} {' '.join(args.overrides)}; device {device}; torch threads {torch.get_num_threads()}; "
          f"batch {config.train.batch_size}, crop {config.data.crop_size}, amp {config.train.amp}, "
          f"workers {config.data.num_workers}, {args.iters} iterations per round")
    print("full = Trainer.fit (data loading, loss, AMP, schedule, logging); step = Trainer.train_step on "
          "preloaded batches (the loop without its input pipeline); bare = forward+CE+backward+step")
    print(f"{'round':>6}  {'full s/iter':>11}  {'step s/iter':>11}  {'bare s/iter':>11}  {'full/bare':>9}  {'step/bare':>9}")
    for r in rows:
        print(f"{r['round']:>6}  {r['full_s_per_iter']:>11.4f}  {r['train_step_s_per_iter']:>11.4f}  "
              f"{r['bare_s_per_iter']:>11.4f}  {r['ratio']:>9.3f}  {r['train_step_ratio']:>9.3f}")
    print(f"{'median':>6}  {full_median:>11.4f}  {step_median:>11.4f}  {bare_median:>11.4f}  {ratio_median:>9.3f}  "
          f"{step_ratio_median:>9.3f}   (target full/bare <= 1.10)")
    def column(key: str) -> list[float]:
        return [r[key] for r in rows]

    targets = [judge("train full/bare loop", paired(column("full_s_per_iter"), column("bare_s_per_iter")),
                     target=1.10, control=paired(column("bare_copy_s_per_iter"), column("bare_s_per_iter")))]
    print_targets(targets)
    write_record("bench_train", args.output, {
        "config": args.config, "overrides": args.overrides, "device": str(device),
        "iters_per_round": args.iters, "rounds": rows, "environment": environment(device=str(device)),
        "median_full_s_per_iter": full_median, "median_bare_s_per_iter": bare_median,
        "median_paired_ratio": ratio_median, "median_train_step_s_per_iter": step_median,
        "median_train_step_ratio": step_ratio_median, "targets": targets,
    })
    return 0


if __name__ == "__main__":
    stable_allocator("benchmarks.bench_train", sys.argv[1:])  # re-executes once, when run as a program
    sys.exit(main())
