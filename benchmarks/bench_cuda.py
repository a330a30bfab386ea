"""GPU figures for scripts/gpu_check.sh: synchronized BN against torch's layers, and training throughput.

    python -m benchmarks.bench_cuda [--repeats 30] [--train-iters 40] [--output results.json]

1. One process, per shape (forward + backward, float32 and float16 input): nn.BatchNorm2d, our
   SynchronizedBatchNorm2d (one device: the built-in), our synchronized path (statistics merged by the
   synchronized graph, no peer), torch.nn.SyncBatchNorm's autograd function on a one-process group.
   Paired ratios to nn.BatchNorm2d, with the A/A control (benchmarks/common.py).
2. Two processes (NCCL, when there are 2 GPUs): our layer vs torch.nn.SyncBatchNorm vs local BN.
3. Training: images/s and peak memory of the DeepLabV3+ / ResNet-50 trainer on synthetic 512 px
   crops, fp32 against fp16 autocast with channels_last (same batches, alternating rounds).
On a CPU-only machine (`--device cpu`, tiny sizes) it runs part 1 only, to check the code paths (and, unless
--train-iters 0, imports the engine that part 3 needs, to check that it imports).

The JSON is written after each part, so the layer figures and verdicts survive a later part that fails or a
timeout that kills the process. A part that raises (the engine's requirements missing, NCCL failing) is
recorded as {"error": "..."} with its traceback on stderr, the next part runs, and the exit status is 1;
a part that cannot run here is recorded as {"skipped": "<why>"}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction

from benchmarks.bench_syncbn import layer_inputs
from benchmarks.common import environment, judge, paired, print_targets, summary, time_interleaved, write_record
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

SHAPES = [(8, 64, 128, 128), (4, 256, 65, 65), (16, 512, 33, 33)]
TINY_SHAPES = [(4, 8, 16, 16)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _layer_variants(shape, device, dtype, group) -> dict:
    channels = shape[1]
    x, upstream, builtin, builtin_copy = layer_inputs(shape, device, dtype)
    ours = SynchronizedBatchNorm2d(channels).to(device)
    weight, bias = builtin.weight, builtin.bias
    running_mean, running_var = torch.zeros(channels, device=device), torch.ones(channels, device=device)

    def step(forward):
        def run():
            x.grad = None
            forward().backward(upstream)
        return run

    variants = {
        "nn.BatchNorm2d": step(lambda: builtin(x)),
        "nn.BatchNorm2d copy": step(lambda: builtin_copy(x)),
        "ours one device": step(lambda: ours(x)),
        "ours synchronized path": step(lambda: ours._forward_synchronized(x, None, 0.1, ours.running_mean,
                                                                        ours.running_var)),
    }
    if group is not None:
        variants["torch SyncBatchNorm fn"] = step(lambda: TorchSyncBatchNormFunction.apply(
            x, weight, bias, running_mean, running_var, 1e-5, 0.1, group, dist.get_world_size(group)))
    return variants


def single_process(device: torch.device, repeats: int, shapes) -> tuple[list[dict], list[dict]]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    rows, targets = [], []
    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    try:
        for shape in shapes:
            for dtype in (torch.float32, torch.float16) if device.type == "cuda" else (torch.float32,):
                # torch's function has CUDA kernels only
                variants = _layer_variants(shape, device, dtype, dist.group.WORLD if device.type == "cuda" else None)
                times = time_interleaved(variants, repeats, before=synchronize, after=synchronize)
                base = times["nn.BatchNorm2d"]
                row = {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
                       "ms": {name: summary(t, 1000) for name, t in times.items()},
                       "vs_batchnorm": {name: paired(t, base) for name, t in times.items()}}
                rows.append(row)
                label = f"{'x'.join(map(str, shape))} {row['dtype']}"
                control = row["vs_batchnorm"]["nn.BatchNorm2d copy"]
                targets.append(judge(f"cuda ours one device / BN {label}", row["vs_batchnorm"]["ours one device"],
                                     target=1.03, control=control))
                if "torch SyncBatchNorm fn" in times:
                    targets.append(judge(f"cuda ours sync path / torch SyncBN fn {label}",
                                         paired(times["ours synchronized path"], times["torch SyncBatchNorm fn"]),
                                         target=1.5, control=control))
    finally:
        dist.destroy_process_group()
        Path(store.name).unlink(missing_ok=True)  # the file store may have removed it
    return rows, targets


def _two_process_worker(rank: int, port: int, repeats: int, out_path: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120), device_id=device)
    rows = []
    for shape in SHAPES:
        local = (shape[0] // 2, *shape[1:])
        channels = shape[1]
        x = torch.randn(local, device=device).requires_grad_()
        upstream = torch.randn(local, device=device)
        ours = SynchronizedBatchNorm2d(channels).to(device)
        theirs = nn.SyncBatchNorm(channels).to(device)
        plain, plain_copy = nn.BatchNorm2d(channels).to(device), nn.BatchNorm2d(channels).to(device)

        def step(module):
            def run():
                x.grad = None
                module(x).backward(upstream)
            return run

        variants = {"local BN": step(plain), "local BN copy": step(plain_copy), "ours": step(ours),
                    "torch SyncBatchNorm": step(theirs)}
        times = time_interleaved(variants, repeats, before=lambda: (torch.cuda.synchronize(device), dist.barrier()),
                                 after=lambda: torch.cuda.synchronize(device))
        rows.append({"shape": list(shape), "ms": {name: summary(t, 1000) for name, t in times.items()},
                     "ours_vs_torch": paired(times["ours"], times["torch SyncBatchNorm"]),
                     "control": paired(times["local BN copy"], times["local BN"])})
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def two_processes(repeats: int) -> tuple[list[dict], list[dict]]:
    out_path = Path(tempfile.gettempdir()) / f"bench_cuda_two_{os.getpid()}.json"
    mp.start_processes(_two_process_worker, args=(_free_port(), repeats, str(out_path)), nprocs=2,
                       start_method="spawn")
    rows = json.loads(out_path.read_text())
    out_path.unlink()
    targets = [judge(f"cuda 2-GPU ours / torch SyncBN {'x'.join(map(str, r['shape']))}", r["ours_vs_torch"],
                     target=1.2, control=r["control"]) for r in rows]
    return rows, targets


def _import_trainer():
    """The engine's entry points part 3 needs: imported only then (they need the runtime requirements,
    albumentations included, where parts 1 and 2 need torch alone)."""
    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import setup_distributed
    from syncseg.engine.trainer import Trainer

    return load_config, setup_distributed, Trainer


def training(iters: int, rounds: int) -> dict:
    """images/s and peak memory: fp32 vs fp16 autocast + channels_last, rounds alternating."""
    import logging

    load_config, setup_distributed, Trainer = _import_trainer()
    logging.basicConfig(level=logging.WARNING)
    common = ["model.backbone=resnet50", "model.head_channels=256", "model.aspp_rates=", "data.synthetic_image_size=512",
              "data.crop_size=512", "data.scale_range=1,1", "data.synthetic_train_size=400", "data.num_workers=8",
              "train.batch_size=8", "train.iters=100000", "train.val_interval=100000", "train.ckpt_interval=100000",
              "train.log_interval=100000"]
    settings = {"fp32": ["train.amp=off", "model.channels_last=false"],
                "fp16_channels_last": ["train.amp=fp16", "model.channels_last=true"]}
    results: dict = {}
    with tempfile.TemporaryDirectory() as root:
        trainers = {name: Trainer.from_config(load_config("demo.yaml", [f"output_dir={root}/{name}", *common, *extra]),
                                  setup_distributed(None), progress=False) for name, extra in settings.items()}
        for trainer in trainers.values():
            trainer.fit(stop_at=5)  # warm-up: cudnn autotuning, workers, renders
        seconds = {name: [] for name in trainers}
        for round_index in range(rounds):
            names = list(trainers) if round_index % 2 == 0 else list(trainers)[::-1]
            for name in names:
                torch.cuda.reset_peak_memory_stats()
                trainer = trainers[name]
                result = trainer.fit(stop_at=trainer.iteration + iters)
                seconds[name].append(result.train_seconds)
                results.setdefault(name, {})["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        for name, trainer in trainers.items():
            trainer.close()
            results[name]["images_per_s"] = 8 * iters / statistics.median(seconds[name])
    results["speedup_fp16_channels_last"] = paired(seconds["fp32"], seconds["fp16_channels_last"])
    return results


def _failure(part: str, error: BaseException) -> dict:
    print(f"bench_cuda: {part} failed:", file=sys.stderr)
    traceback.print_exc()
    return {"error": f"{type(error).__name__}: {error}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repetitions of every layer variant")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default when available) or cpu (tiny shapes: checks the code paths only)")
    parser.add_argument("--train-iters", type=int, default=40, help="iterations per training round (0: skip)")
    parser.add_argument("--train-rounds", type=int, default=3, help="alternating rounds of fp32 and fp16 training")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/bench_cuda.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    gpus = torch.cuda.device_count()
    env = environment(device=str(device), gpus=gpus,
                      gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    targets: list[dict] = []
    record: dict = {"environment": env, "targets": targets}
    failed = False

    # 1. layers, one process: figures and verdicts written before anything else runs
    try:
        rows, layer_targets = single_process(device, args.repeats, SHAPES if device.type == "cuda" else TINY_SHAPES)
    except Exception as error:  # noqa: BLE001 - recorded, then the next part runs
        record["single_process"], failed = _failure("part 1 (layers, one process)", error), True
    else:
        record["single_process"] = rows
        targets += layer_targets
        for row in rows:
            print(f"{tuple(row['shape'])} {row['dtype']}: " + ", ".join(
                f"{name} {row['ms'][name]['median']:.3f} ms" for name in row["ms"]))
        if layer_targets:
            print_targets(layer_targets)
    write_record("bench_cuda", args.output, record)

    # 2. layers, two NCCL processes
    if device.type != "cuda" or gpus < 2:
        record["two_processes"] = {"skipped": f"needs 2 CUDA devices; {device.type} with {gpus} GPU(s) here"}
    else:
        try:
            record["two_processes"], more = two_processes(args.repeats)
        except Exception as error:  # noqa: BLE001
            record["two_processes"], failed = _failure("part 2 (layers, two processes)", error), True
        else:
            targets += more
            for row in record["two_processes"]:
                print(f"2 GPUs {tuple(row['shape'])}: " + ", ".join(
                    f"{name} {row['ms'][name]['median']:.3f} ms" for name in row["ms"]))
            print_targets(more)
        write_record("bench_cuda", args.output, record)

    # 3. training throughput: imports the engine (the runtime requirements); on CPU only the import is checked
    if args.train_iters <= 0:
        record["training"] = {"skipped": "--train-iters 0"}
    else:
        try:
            if device.type != "cuda":
                _import_trainer()
                record["training"] = {"skipped": f"needs a CUDA device (ran on {device}); the engine imports"}
            else:
                record["training"] = training(args.train_iters, args.train_rounds)
        except Exception as error:  # noqa: BLE001 - an ImportError here must not lose parts 1 and 2
            record["training"], failed = _failure("part 3 (training)", error), True
        else:
            if "speedup_fp16_channels_last" in record["training"]:
                for name in ("fp32", "fp16_channels_last"):
                    figures = record["training"][name]
                    print(f"training {name}: {figures['images_per_s']:.1f} images/s, "
                          f"peak {figures['peak_memory_mb']:.0f} MiB")
                speedup = judge("cuda training fp16+channels_last speedup",
                                record["training"]["speedup_fp16_channels_last"], target=1.0, control=None,
                                higher_is_better=True)
                targets.append(speedup)
                print_targets([speedup])
    for part in ("two_processes", "training"):
        if isinstance(record.get(part), dict) and "skipped" in record[part]:
            print(f"{part}: skipped ({record[part]['skipped']})")
    write_record("bench_cuda", args.output, record)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
