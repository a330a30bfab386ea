"""Cost of experiment tracking and an object-store run dir in the training loop (issue 50's target).

Three Trainers of the same config run in one process, interleaved in rounds (a balanced order): "local", the
default (TensorBoard and metrics.jsonl, run dir on local disk); "mlflow_s3", log.loggers=[tensorboard, mlflow]
to a real `mlflow server` on loopback and output_dir=s3://... on moto's S3 server on loopback (last.pt
uploaded in the background after each save); and "local_again", the A/A control. A round gives each variant
`--steps` training steps through Trainer.fit, with a log record every train.log_interval steps and a
checkpoint every train.ckpt_interval (set so that each timed segment holds one save at its middle, whose
upload overlaps the segment's second half). What is still uploading when a segment ends is waited for
outside the clock, so it does not fall on the next variant's steps. Target: median paired ratio
mlflow_s3 / local <= 1.03.

The servers run on this machine under SCHED_IDLE: on a cluster they are other machines, and here they would
otherwise take the cores the steps run on. The client side runs as users get it: MLflow's client in its
thread of the training process, the uploads in syncseg's upload process (SCHED_IDLE too, as always). The
table also says how long the uploads took past each segment's end (the save at the segment's end is
uploaded then, outside the clock).

    python -m benchmarks.bench_tracking [--config demo.yaml] [--rounds 6] [--steps 40] [KEY=VALUE ...]
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import balanced_orders, config_parser, environment, judge, paired, print_targets, stable_allocator
from benchmarks.common import quiet_gc, summary, write_record


@contextlib.contextmanager
def _niced_servers(folder: Path):
    """moto's S3 server and an mlflow server on loopback, at SCHED_IDLE; yields (S3 environment, MLflow URI)."""
    from syncseg.engine.upload_worker import lower_priority  # SCHED_IDLE, as syncseg's uploads run
    from tests.object_store import s3_client, s3_server
    from tests.trackers import mlflow_server

    with s3_server(folder / "s3", preexec_fn=lower_priority) as env, \
            mlflow_server(folder / "mlflow", preexec_fn=lower_priority) as uri:
        s3_client(env).create_bucket(Bucket="bench")
        yield env, uri


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("bench_tracking", __doc__)
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (each variant once a round)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per variant and round")
    args = parser.parse_intermixed_args(argv)
    stable_allocator("benchmarks.bench_tracking", sys.argv[1:] if argv is None else argv)

    import logging

    from syncseg.engine.build import build_training
    from syncseg.engine.distributed import setup_distributed
    from syncseg.engine.run_plan import plan_run
    from syncseg.engine.trainer import Trainer

    logging.basicConfig(level=logging.WARNING)
    steps = args.steps
    # a save at the middle of every timed segment (the first, untimed, segment is half as long)
    common = [*args.overrides, f"train.ckpt_interval={steps}", "train.val_interval=1000000",
              f"train.iters={steps * (3 * args.rounds + 2)}", "train.num_vis_images=0"]
    with tempfile.TemporaryDirectory() as folder, _niced_servers(Path(folder)) as (env, uri):
        os.environ.update(env)
        os.environ["SYNCSEG_CACHE_DIR"] = str(Path(folder) / "cache")
        info = setup_distributed(None)
        variants = {
            "local": [f"output_dir={folder}/local"],
            "mlflow_s3": ["output_dir=s3://bench/runs/x", "log.loggers=tensorboard,mlflow", f"log.mlflow_uri={uri}"],
            "local_again": [f"output_dir={folder}/local_again"],
        }
        trainers, plans = {}, {}
        for name, extra in variants.items():
            plan = plan_run(args.config, None, [*common, *extra], dist_info=info)
            if plan.remote is not None:
                plan.remote.start()
            trainer = Trainer(build_training(plan.config, info), run_id=plan.run_id, overrides=plan.overrides,
                              progress=False)
            if plan.remote is not None:
                trainer.checkpointer.on_saved = plan.remote.request_upload
            trainer.fit(stop_at=steps // 2)  # warm-up, untimed
            trainers[name], plans[name] = trainer, plan
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        orders = balanced_orders(list(variants))
        drained: list[float] = []  # seconds the uploads still took after a mlflow_s3 segment's last step
        for round_index in range(args.rounds):
            for name in orders[round_index % len(orders)]:
                trainer, plan = trainers[name], plans[name]
                with quiet_gc():
                    start = time.perf_counter()
                    trainer.fit(stop_at=trainer.iteration + steps)
                    seconds[name].append(time.perf_counter() - start)
                if plan.remote is not None:
                    start = time.perf_counter()
                    if not plan.remote.wait_idle(300):
                        raise RuntimeError("an upload did not finish within 300 s")
                    drained.append(time.perf_counter() - start)
        uploaded = plans["mlflow_s3"].remote.fs.ls(plans["mlflow_s3"].remote.root, detail=True)
        last_mb = next(item["size"] for item in uploaded if item["name"].endswith("/last.pt")) / 2**20
        for name in variants:
            trainers[name].close()
            plans[name].release()
    ratio = paired(seconds["mlflow_s3"], seconds["local"])
    control = paired(seconds["local_again"], seconds["local"])
    step_ms = summary(seconds["local"], scale=1e3 / steps)
    print(f"tracking and object-store run dir, config {args.config} {' '.join(args.overrides)}; "
          f"{args.rounds} rounds of {steps} steps, a last.pt of {last_mb:.0f} MiB uploaded every {steps} steps")
    print(f"  local step               median {step_ms['median']:9.2f} ms")
    print(f"  mlflow_s3 / local        median {ratio['median']:.4f} (IQR {ratio['q1']:.4f}-{ratio['q3']:.4f})")
    print(f"  local_again / local      median {control['median']:.4f} (A/A control)")
    print(f"  uploads left at a segment's end: median {statistics.median(drained):.2f} s (the last save's upload, "
          f"waited for outside the clock; max {max(drained):.2f} s)")
    targets = [judge("step with MLflow + s3:// run dir / local TensorBoard only", ratio, target=1.03, control=control)]
    print_targets(targets)
    write_record("bench_tracking", args.output, {
        "environment": environment(servers="moto_server and mlflow server on loopback at SCHED_IDLE"),
        "config": args.config, "overrides": args.overrides, "steps": steps, "last_pt_mib": last_mb,
        "step_ms": step_ms, "upload_drain_s": summary(drained), "ratio": ratio, "control": control, "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
