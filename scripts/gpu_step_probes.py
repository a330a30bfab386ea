"""The measurements of scripts/gpu_check.sh and the fused-gradient check (subcommands of scripts.gpu_probes).

    step         one DeepLabV3+ / ResNet-101 training step (Trainer.train_step) in bf16 and channels-last at 512 px:
                 images/s, peak memory, FLOPs per step (torch.utils.flop_counter) and MFU against the device's
                 dense bf16 peak (a table of data-sheet figures) and against a bf16 matmul measured here
    step-norms   the same step in two processes on the one GPU with our synchronized BatchNorm, torch.nn.SyncBatchNorm
                 and BatchNorm2d (plus a BatchNorm2d copy: the A/A control), interleaved; over NCCL where NCCL
                 accepts two ranks on one GPU, else over gloo on CUDA tensors (said)
    host-syncs   one training step of the demo's model, loss (CE + Dice, aux head) and AdamW at 256 px under
                 torch.cuda.set_sync_debug_mode("warn"): the warnings counted, on the one-process path and the
                 synchronized one (a 1-process NCCL group), bf16; fp16's count (GradScaler) reported
    fused-grad   our synchronized layer's forward and fused input gradient against nn.BatchNorm2d, both against float64,
                 fp32 and bf16, NCHW and NHWC

Each prints `RECORD: {json}` lines as it goes (the last one is its record in measurements.json) and works to the
time left (`time_left()`, from --deadline), so that a measurement cut short still reports what it measured.
On a CPU (the dry run) each runs on tiny shapes in fp32.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

from scripts import gpu_probes
from scripts.gpu_probes import FAILED, PASSED, first_line, result, synchronize, time_left

# Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s, no sparsity), matched against
# torch.cuda.get_device_name in this order; a device not listed gets its MFU against the measured matmul only.
BF16_PEAK_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
                    ("H100", 989.4), ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0))


def record(payload: dict) -> None:
    print(f"RECORD: {json.dumps(payload, default=float)}", flush=True)


def bf16_peak(name: str) -> float | None:
    return next((tflops for key, tflops in BF16_PEAK_TFLOPS if key in name), None)


def step_setup(device: torch.device, *, config: str, image_size: int, batch_size: int, norm: str | None = None,
               num_classes: int = 21):
    """(harness, batch, model config) of one training step: the config's model (random weights), loss and
    optimizer; bf16 and channels-last on a GPU, fp32 on a CPU."""
    from benchmarks.host_syncs import step_batch, step_harness
    from syncseg.engine.config import load_config
    from syncseg.model.builder import build_model

    overrides = ["model.pretrained_backbone=none"] + ([f"model.norm={norm}"] if norm else [])
    cfg = load_config(config, overrides)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True  # as training sets it (syncseg.engine.distributed)
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes, in_channels=cfg.data.in_channels, channels_last=cuda)
    model = model.to(device).train()
    harness = step_harness(model, cfg.train, cfg.data, device, precision="bf16" if cuda else "off")
    batch = step_batch(cfg.data, num_classes=num_classes, image_size=image_size, batch_size=batch_size)
    if cuda:
        batch = [(images.pin_memory(), masks.pin_memory()) for images, masks in batch]  # as the loader pins them
    return harness, batch, cfg


def _matmul_tflops(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12


# ------------------------------------------------------------------------------------------------ step
def step(device: torch.device) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    from syncseg.engine.trainer import Trainer

    cuda = device.type == "cuda"
    size, batch_size, config = (512, 8, "voc.yaml") if cuda else (64, 2, "demo.yaml")
    harness, batch, cfg = step_setup(device, config=config, image_size=size, batch_size=batch_size)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    out = {"device": name, "config": config, "model": f"{cfg.model.arch} / {cfg.model.backbone} OS{cfg.model.output_stride}",
           "image_size": size, "batch_size": batch_size, "precision": harness.parts.precision, "channels_last": cuda}
    record(out)
    began = time.perf_counter()
    for _ in range(3):  # cuDNN autotuning, the optimizer state, the constants
        Trainer.train_step(harness, batch)
    synchronize(device)
    out["warmup_s"] = round(time.perf_counter() - began, 2)
    with FlopCounterMode(display=False) as counter:
        Trainer.train_step(harness, batch)
    out["flops_per_step"] = counter.get_total_flops()
    record(out)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    per_window, times, losses = (10 if cuda else 2), [], []
    while len(times) < 7 and (not times or time_left() > 3 * times[-1] * per_window + 5):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(per_window):
            loss = Trainer.train_step(harness, batch)
        synchronize(device)
        times.append((time.perf_counter() - start) / per_window)
        losses.append(float(loss))
        seconds = statistics.median(times)
        out.update(windows=len(times), steps_per_window=per_window, step_ms=round(seconds * 1e3, 2),
                   step_ms_range=[round(min(times) * 1e3, 2), round(max(times) * 1e3, 2)],
                   images_per_s=round(batch_size / seconds, 1),
                   achieved_tflops=round(out["flops_per_step"] / seconds / 1e12, 1), losses=losses)
        if cuda:
            out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        record(out)
    if not times:
        result("no timed window fitted in the time left")
        return FAILED
    peak = bf16_peak(name) if cuda else None
    if cuda:
        out["matmul_bf16_tflops"] = round(_matmul_tflops(device), 1)
        out["fraction_of_matmul"] = round(out["achieved_tflops"] / out["matmul_bf16_tflops"], 3)
    out["peak_bf16_tflops"] = peak
    out["mfu"] = round(out["achieved_tflops"] / peak, 3) if peak else None
    record(out)
    mfu = (f"MFU {out['mfu']:.1%} of {peak:g} TFLOP/s (data sheet)" if peak
           else f"MFU not computed: no bf16 peak known for {name}")
    measured = (f", {out['fraction_of_matmul']:.1%} of an 8192^3 bf16 matmul here ({out['matmul_bf16_tflops']:g})"
                if cuda else "")
    memory = f", peak memory {out['peak_memory_gib']} GiB" if cuda else ""
    result(f"{out['model']} {out['precision']}{' channels-last' if cuda else ''} {batch_size}x{size}px: "
           f"{out['images_per_s']} img/s ({out['step_ms']} ms a step, {len(times)} windows of {per_window}){memory}, "
           f"{out['flops_per_step'] / 1e9:.1f} GFLOP a step, {out['flops_per_step'] / seconds / 1e12:.3g} TFLOP/s; "
           f"{mfu}{measured}")
    return PASSED if all(math.isfinite(value) for value in losses) else FAILED


# ------------------------------------------------------------------------------------------------ step-norms
NORM_VARIANTS = ("ours", "torch_syncbn", "bn", "bn_copy")


def _norms_worker(rank: int, device_name: str, store: str, out: str, deadline: float) -> None:
    import torch.distributed as dist

    from benchmarks.common import balanced_orders, paired
    from syncseg.engine.trainer import Trainer
    from syncseg.model.sync_batchnorm.batchnorm import _SynchronizedBatchNorm

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    rec: dict = {"rank": rank}
    gpu_probes._join(rank, store, timeout_s=60)
    try:
        group, rec["transport"] = None, "gloo (CPU tensors)"
        if cuda:
            # a refusal must stay an exception here: no watchdog tearing the process down after it
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
            try:
                nccl = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=20))
                probe = torch.ones(1, device=device)
                dist.all_reduce(probe, group=nccl)
                synchronize(device)
                group, rec["transport"] = nccl, "nccl"
            except Exception as error:  # noqa: BLE001 - NCCL's answer decides the transport, and is reported
                rec["transport"] = f"gloo on CUDA tensors (NCCL refused two ranks on one GPU: {first_line(error)[:200]})"
        size, per_rank, config = (512, 4, "voc.yaml") if cuda else (64, 2, "demo.yaml")
        rec.update(image_size=size, batch_per_process=per_rank, config=config)
        steps, names = {}, list(NORM_VARIANTS if cuda else ("ours", "bn", "bn_copy"))
        if not cuda:
            rec["torch_syncbn"] = "not run: torch.nn.SyncBatchNorm takes CUDA tensors only"
        for name in names:
            harness, batch, cfg = step_setup(device, config=config, image_size=size, batch_size=per_rank,
                                             norm="syncbn" if name == "ours" else "bn")
            rec["model"] = f"{cfg.model.arch} / {cfg.model.backbone}"
            batch = [(images.roll(rank, 0), masks.roll(rank, 0)) for images, masks in batch]  # the ranks' data differ
            model = harness.model
            if name == "ours":
                for module in model.modules():
                    if isinstance(module, _SynchronizedBatchNorm):
                        module.process_group = group
            elif name == "torch_syncbn":
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
                harness.parts.train_model = harness.parts.forward_model = harness.model = model
            steps[name] = (harness, batch)
        times: dict[str, list[float]] = {name: [] for name in names}
        orders = balanced_orders(names)
        per_sample = 3 if cuda else 1

        def sample(name: str) -> float:
            harness, batch = steps[name]
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            for _ in range(per_sample):
                loss = Trainer.train_step(harness, batch)
            synchronize(device)
            seconds = (time.perf_counter() - start) / per_sample
            if not math.isfinite(float(loss)):
                raise FloatingPointError(f"{name}: loss {float(loss)}")
            return seconds

        for name in names:  # warm-up: autotuning, optimizer state
            sample(name)
        rounds, last = 0, 0.0
        while rounds < (40 if cuda else 4):  # on a CPU (the dry run) a rehearsal
            go = torch.tensor([1.0 if time.time() + 2 * last + 8 < deadline else 0.0])
            dist.broadcast(go, src=0)  # rank 0's clock decides, so both stop after the same round
            if go.item() == 0.0:
                break
            began = time.time()
            for name in orders[rounds % len(orders)]:
                times[name].append(sample(name))
            rounds, last = rounds + 1, time.time() - began
            rec["rounds"] = rounds
            rec["step_ms"] = {name: round(statistics.median(values) * 1e3, 2) for name, values in times.items()}
            ratios = {"ours / bn": paired(times["ours"], times["bn"]), "bn_copy / bn (A/A)": paired(times["bn_copy"], times["bn"])}
            if "torch_syncbn" in times:
                ratios["ours / torch_syncbn"] = paired(times["ours"], times["torch_syncbn"])
                ratios["torch_syncbn / bn"] = paired(times["torch_syncbn"], times["bn"])
            rec["ratios"] = {key: {k: round(v, 3) for k, v in value.items()} for key, value in ratios.items()}
            if rank == 0:
                record(rec)
            gpu_probes._save(out, rank, rec)
        gpu_probes._save(out, rank, rec)
        dist.barrier()
    except Exception as error:  # noqa: BLE001
        rec["error"] = "".join(traceback.format_exception(error))[-3000:]
        gpu_probes._save(out, rank, rec)
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def step_norms(device: torch.device) -> int:
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    deadline = time.time() + time_left() - 4
    records = gpu_probes._spawn_two(_norms_worker, device, max(10.0, time_left() - 3), deadline)
    rec = records[0]
    if "error" in rec or not rec.get("rounds"):
        result(f"two processes on {device} did not measure a round: "
               f"{(rec.get('error') or 'no result').strip().splitlines()[-1][:300]}")
        return FAILED
    record(rec)
    ratios = rec["ratios"]
    control = ratios["bn_copy / bn (A/A)"]["median"]
    parts = [f"{name} {ms} ms" for name, ms in rec["step_ms"].items()]
    verdict, ok = "", True
    if "ours / torch_syncbn" in ratios:
        ours = ratios["ours / torch_syncbn"]["median"]
        noisy = abs(control - 1) > 0.05
        ok = noisy or ours <= 1.2
        verdict = (f"; ours / torch.nn.SyncBatchNorm {ours:.3f} (target <= 1.2: "
                   f"{'NOISY, A/A beyond 1.05' if noisy else 'PASS' if ours <= 1.2 else 'FAIL'})")
    result(f"{rec['model']} step, 2 processes x {rec['batch_per_process']} at {rec['image_size']} px on {device} "
           f"over {rec['transport'][:120]}, no DDP (the norms' cost alone), {rec['rounds']} rounds: " + ", ".join(parts)
           + f"; ours / bn {ratios['ours / bn']['median']:.3f}, A/A {control:.3f}{verdict}")
    return PASSED if ok else FAILED


# ------------------------------------------------------------------------------------------------ host-syncs
def _count_sync_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]


def host_syncs(device: torch.device) -> int:
    from benchmarks.host_syncs import one_process_group, training_step_syncs
    from syncseg.engine.trainer import Trainer

    if device.type != "cuda":  # the dry run: the CPU-side count (fake CUDA tensors) of the demo's step
        from syncseg.engine.config import load_config

        cfg = load_config("demo.yaml", ["model.pretrained_backbone=none"])
        counts = {}
        for path, synchronized in (("one process", False), ("synchronized", True)):
            events, _, _ = training_step_syncs(cfg.model, cfg.train, cfg.data, num_classes=6, synchronized=synchronized)
            counts[path] = len(events)
        record({"counted": "on fake CUDA tensors (no GPU)", "syncs": counts})
        result(f"no CUDA: counted on fake CUDA tensors instead: {counts}")
        return PASSED if not any(counts.values()) else FAILED
    device = torch.device("cuda", 0)
    out: dict = {"counted": "torch.cuda.set_sync_debug_mode('warn') over the second Trainer.train_step", "syncs": {},
                 "where": {}}
    for path, precision in (("one process", "bf16"), ("synchronized", "bf16"), ("one process fp16", "fp16")):
        group = one_process_group("nccl") if path == "synchronized" else contextlib.nullcontext()
        with group:
            harness, batch, _ = step_setup(device, config="demo.yaml", image_size=256, batch_size=2, num_classes=6)
            harness.parts.precision = precision
            harness.parts.scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
            Trainer.train_step(harness, batch)  # the optimizer state, the constants
            synchronize(device)
            where = _count_sync_warnings(lambda: Trainer.train_step(harness, batch))
            synchronize(device)
        out["syncs"][f"{path} ({precision})" if "fp16" not in path else path] = len(where)
        out["where"][path] = sorted(set(where))[:10]
        record(out)
        if time_left() < 15:
            break
    judged = {key: value for key, value in out["syncs"].items() if "fp16" not in key}
    where = "; ".join(f"{path}: {', '.join(places)}" for path, places in out["where"].items() if places)
    result(f"host syncs in one step of demo.yaml's deeplabv3plus / resnet18 at 2x256 px: {out['syncs']} (fp16 not judged: its GradScaler reads the inf "
           f"flag){'; at ' + where[:300] if where else ''}")
    return PASSED if len(judged) == 2 and not any(judged.values()) else FAILED


# ------------------------------------------------------------------------------------------------ fused-grad
def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.detach().double().cpu() - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def fused_grad(device: torch.device) -> int:
    from benchmarks.host_syncs import one_process_group
    from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d
    from syncseg.model.sync_batchnorm.functions import uses_fused_kernels

    cuda = device.type == "cuda"
    floors = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
    rows, ok = [], True
    with one_process_group("nccl" if cuda else "gloo"):
        for dtype in (torch.float32, torch.bfloat16):
            for layout in ("NCHW", "NHWC"):
                generator = torch.Generator().manual_seed(1)
                x = torch.randn(4, 32, 17, 19, generator=generator, dtype=torch.float64) * 2 + 0.5
                upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
                weight = torch.rand(32, generator=generator, dtype=torch.float64) + 0.5
                bias = torch.randn(32, generator=generator, dtype=torch.float64)
                reference = torch.nn.BatchNorm2d(32).double()
                with torch.no_grad():
                    reference.weight.copy_(weight), reference.bias.copy_(bias)
                x64 = x.clone().requires_grad_(True)
                out64 = reference(x64)
                out64.backward(upstream)
                expected = (out64.detach(), x64.grad, reference.weight.grad, reference.bias.grad)
                errors = {}
                for name, layer in (("ours", SynchronizedBatchNorm2d(32)), ("nn.BatchNorm2d", torch.nn.BatchNorm2d(32))):
                    layer = layer.to(device).train()
                    with torch.no_grad():
                        layer.weight.copy_(weight), layer.bias.copy_(bias)
                    memory = torch.channels_last if layout == "NHWC" else torch.contiguous_format
                    xd = x.to(device=device, dtype=dtype).contiguous(memory_format=memory).requires_grad_(True)
                    out = layer(xd)
                    out.backward(upstream.to(device=device, dtype=dtype).contiguous(memory_format=memory))
                    got = (out, xd.grad, layer.weight.grad, layer.bias.grad)
                    errors[name] = max(_relative(g, e) for g, e in zip(got, expected))
                    if name == "ours":
                        fused = uses_fused_kernels(xd)
                        kept = out.is_contiguous(memory_format=memory) and xd.grad.is_contiguous(memory_format=memory)
                bar = max(2 * errors["nn.BatchNorm2d"], floors[dtype])
                good = errors["ours"] <= bar and kept and (fused or not cuda)
                ok &= good
                rows.append({"dtype": str(dtype).replace("torch.", ""), "layout": layout, "ours": errors["ours"],
                             "nn.BatchNorm2d": errors["nn.BatchNorm2d"], "bar": bar, "fused_kernels": fused,
                             "layout_kept": kept, "ok": good})
                record({"against": "float64 nn.BatchNorm2d on the CPU", "rows": rows})
    result(f"synchronized layer (1-process {'NCCL' if cuda else 'gloo'} group) against float64, max rel. error of "
           "output and gradients, ours / nn.BatchNorm2d: " + ", ".join(
               f"{r['dtype']} {r['layout']} {r['ours']:.1e} / {r['nn.BatchNorm2d']:.1e}{'' if r['ok'] else ' FAIL'}"
               for r in rows) + ("; fused kernels used" if all(r["fused_kernels"] for r in rows) else
                                 "; NOT the fused kernels" if cuda else ""))
    return PASSED if ok else FAILED


PROBES = {"step": step, "step-norms": step_norms, "host-syncs": host_syncs, "fused-grad": fused_grad}
