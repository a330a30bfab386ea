"""The Python steps of scripts/gpu_check.sh: what a borrowed one-GPU machine can show beyond the test suite.

    python -m scripts.gpu_probes SUBCOMMAND [--device cuda|cpu] [--deadline SECONDS] [...]

Each subcommand prints `RESULT: ...` lines (the last is the step's line in summary.txt) and exits 0 when what it
checks holds, 3 when it cannot run here (the RESULT line says why), 1 when a check failed. `--device cpu` runs
the same code on tiny shapes: gpu_check.sh --dry-run rehearses every probe on a CPU machine. `--deadline`: the
probe's own time limit (gpu_check.sh gives it a few seconds below the step's timeout): measurements fit their
rounds into it (time_left()), and when it passes the probe prints a RESULT line saying so, stops its child
processes and exits 1, so the step reports what was measured instead of being killed. The measurements (step,
step-norms, host-syncs) and fused-grad are in scripts/gpu_step_probes.py.

    unfuse CHECKPOINT      rewrite a last.pt's optimizer state as the unfused optimizer saved it (for the
                           fused-optimizer resume of train_fp16_resume)
    sigterm -- ARGS        run train.py ARGS, send SIGTERM after its first progress line; expects exit 143 and
                           the stop line
    bad-mask -- ARGS       run train.py ARGS with a mask value outside the classes in every synthetic sample;
                           expects exit 2 and the loss's one-line error
    tf32                   fp32 convolution and matmul error and time, amp off against amp tf32
    two-processes          two processes on the one device over gloo: DDP with synchronized BN against
                           nn.BatchNorm2d, NCCL's answer to two ranks on one GPU, a killed peer
    dp-one-gpu             DataParallelWithCallback with two replicas on GPU 0, if torch builds them
    compile                the synchronized layers compiled in two processes on the one device; whether a C
                           compiler (Triton's launcher needs one) and Triton are there
    val-autotune           whole-image validation of varied sizes: cuDNN autotuning every size, none, and
                           evaluate()'s rule (only sizes that come back)
    step, step-norms, host-syncs, fused-grad
                           scripts/gpu_step_probes.py: the training step's speed, memory and MFU; with our
                           SyncBN, torch's and BatchNorm2d; its host syncs; the fused input gradient
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

PASSED, FAILED, NOT_HERE = 0, 1, 3
ROOT = Path(__file__).resolve().parents[1]
_DEADLINE = [float("inf")]  # time.monotonic() at --deadline


def time_left() -> float:
    """Seconds until the probe's --deadline (inf without one)."""
    return _DEADLINE[0] - time.monotonic()


def _start_deadline(seconds: float, probe: str) -> None:
    """At `seconds` from now: a RESULT line, the child processes stopped, exit 1 (the records printed so far stay
    in the log)."""
    import multiprocessing
    import threading

    _DEADLINE[0] = time.monotonic() + seconds

    def expire() -> None:
        result(f"{probe} stopped by its inner deadline of {seconds:g} s (what it measured is in the RECORD lines above)")
        for child in multiprocessing.active_children():
            with contextlib.suppress(Exception):
                child.kill()
        sys.stdout.flush()
        os._exit(FAILED)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def result(line: str) -> None:
    print(f"RESULT: {line}", flush=True)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ checkpoints
def unfuse(path: str) -> int:
    """The optimizer groups of `path` as an optimizer built before fusing saved them (fused and foreach None),
    its step tensors on the CPU (load_checkpoint reads everything there)."""
    from syncseg.engine.checkpoint_file import load_checkpoint, save_checkpoint

    payload = load_checkpoint(path)
    groups = payload["optimizer"]["param_groups"]
    before = sorted({str(group.get("fused")) for group in groups})
    for group in groups:
        group["fused"], group["foreach"] = None, None
    steps = [state["step"] for state in payload["optimizer"]["state"].values() if "step" in state]
    save_checkpoint(path, payload)
    devices = sorted({str(step.device) for step in steps if isinstance(step, torch.Tensor)})
    result(f"{Path(path).name} rewritten as the unfused optimizer saves it: fused {'/'.join(before)} -> None in "
           f"{len(groups)} groups, {len(steps)} step tensors on {'/'.join(devices) or 'no device'}")
    return PASSED


# ------------------------------------------------------------------------------------------------ train.py runs
def sigterm(train_args: list[str]) -> int:
    """train.py with SIGTERM once it has logged a step: the step in progress finishes, last.pt is saved, the
    exit status is 143 and rank 0 says where it stopped."""
    process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *train_args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines, sent = [], None
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line)
        if sent is None and re.search(r" iter \d+/\d+ ", line):
            process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
    code = process.wait()
    text = "".join(lines)
    precision = re.search(r"train\.amp=\S+: .*", text)
    stopped = re.search(r"stopped by SIGTERM at iteration (\d+)", text)
    if sent is None:
        result(f"train.py exited {code} before logging a step; no SIGTERM sent")
        return FAILED
    took = time.monotonic() - sent
    if code != 128 + signal.SIGTERM or not stopped:
        result(f"SIGTERM after the first progress line: exit {code} (expected 143), "
               f"{'the stop line' if stopped else 'no stop line'}; {precision.group(0) if precision else ''}")
        return FAILED
    result(f"SIGTERM mid-step: exit 143 {took:.0f} s later, stopped at iteration {stopped.group(1)} with last.pt "
           f"saved; {precision.group(0) if precision else 'no precision line'}")
    return PASSED


def bad_mask(train_args: list[str]) -> int:
    """train.py in this process with a value 9 in the first pixel of every synthetic mask (6 classes): the
    loader refuses the batch on the CPU with the loss's one-line error (exit 2); on CUDA the value must not
    reach cross-entropy, whose device-side assert would poison the context."""
    from syncseg.commands.train import main
    from syncseg.data.synthetic import SyntheticShapes

    original = SyntheticShapes.__getitem__

    def with_a_bad_value(self, index):
        image, mask = original(self, index)
        mask = mask.clone()
        mask[0, 0] = 9
        return image, mask

    SyntheticShapes.__getitem__ = with_a_bad_value
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        code = main(train_args)
    text = captured.getvalue()
    print(text, end="", flush=True)
    expected = "mask value 9 is not a class index in 0..5 nor ignore_index=255"
    error_lines = [line for line in text.splitlines() if "train.py: error:" in line]
    if code == 2 and len(error_lines) == 1 and expected in error_lines[0] and "device-side assert" not in text:
        result(f"a mask value outside the classes: exit 2 and one line: ...{expected}")
        return PASSED
    result(f"a mask value outside the classes: exit {code} (expected 2); error lines: "
           f"{error_lines or 'none'}{'; a device-side assert' if 'device-side assert' in text else ''}")
    return FAILED


# ------------------------------------------------------------------------------------------------ TF32
def tf32(device: torch.device) -> int:
    """The error (against float64) and time of an fp32 convolution and matmul as `amp: off` and `amp: tf32`
    run them: off must be IEEE fp32 (TF32 errors are ~1e-3 relative, fp32's ~1e-6)."""
    from syncseg.engine import devices

    generator = torch.Generator().manual_seed(0)
    size = 2048 if device.type == "cuda" else 128
    a, b = (torch.randn(size, size, generator=generator) for _ in range(2))
    x = torch.randn(8, 64, 64 if device.type == "cuda" else 16, 64 if device.type == "cuda" else 16, generator=generator)
    weight = torch.randn(64, 64, 3, 3, generator=generator) / 24
    references = {"matmul": (a.double() @ b.double()),
                  "conv": torch.nn.functional.conv2d(x.double(), weight.double(), padding=1)}
    a, b, x, weight = (t.to(device) for t in (a, b, x, weight))
    runs = {"matmul": lambda: a @ b, "conv": lambda: torch.nn.functional.conv2d(x, weight, padding=1)}
    errors, parts = {}, []
    for amp in ("off", "tf32"):
        chosen = devices.resolve_precision(amp, device)[0]
        with devices.autocast_for(device, amp):
            flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            for name, run in runs.items():
                run()  # warm-up (cuBLAS / cuDNN handles)
                synchronize(device)
                start = time.perf_counter()
                for _ in range(5):
                    out = run()
                synchronize(device)
                seconds = (time.perf_counter() - start) / 5
                reference = references[name]
                error = float((out.double().cpu() - reference).abs().max() / reference.abs().max())
                errors[amp, name] = error
                parts.append(f"{amp} (runs {chosen}, TF32 flags {flags[0]}/{flags[1]}) {name}: rel. error "
                             f"{error:.1e}, {seconds * 1e3:.2f} ms")
    for part in parts:
        print(part, flush=True)
    off_is_fp32 = max(errors["off", name] for name in runs) < 1e-4
    summary = "; ".join(f"{name}: off {errors['off', name]:.0e} / tf32 {errors['tf32', name]:.0e}" for name in runs)
    result(f"rel. errors {summary}{'' if device.type == 'cuda' else ' (no TF32 on a CPU)'}; times in probes.txt")
    return PASSED if off_is_fp32 else FAILED


# ------------------------------------------------------------------------------------------------ two processes
SPLITS = (3, 5)  # per rank: uneven on purpose
CHANNELS = 8


def _small_net(norm):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, CHANNELS, 3, padding=1), norm(CHANNELS), torch.nn.ReLU(),
                               torch.nn.Conv2d(CHANNELS, CHANNELS, 1), norm(CHANNELS))


def _global_batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(sum(SPLITS), 3, 12, 10, generator=generator) * (1 + step) + 1
    return x, torch.randn(sum(SPLITS), CHANNELS, 12, 10, generator=generator)


def _train_steps(model, forward, x_of, upstream_of, steps: int, *, scale: float) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, upstream = x_of(step), upstream_of(step)
        loss = (forward(x) * upstream).sum() / (sum(SPLITS) * upstream[0].numel())
        (loss * scale).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _join(rank: int, store: str, timeout_s: float = 30) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _save(out: str, rank: int, record: dict) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _two_process_worker(rank: int, device_name: str, store: str, out: str) -> None:
    import torch.distributed as dist

    from syncseg.engine.distributed import distributed_data_parallel, is_communication_error
    from syncseg.engine.launch_hints import lost_contact_message
    from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

    device = torch.device(device_name)
    record: dict = {}
    _join(rank, store)
    try:
        start = sum(SPLITS[:rank])
        local = slice(start, start + SPLITS[rank])
        model = _small_net(SynchronizedBatchNorm2d).to(device)
        ddp = distributed_data_parallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        # DDP averages gradients over the 2 processes; scaling by 2 makes that the sum of their loss shares
        losses = _train_steps(model, ddp, lambda step: _global_batch(step)[0][local].to(device),
                              lambda step: _global_batch(step)[1][local].to(device), 3, scale=2)
        total = torch.tensor(losses, device=device)
        dist.all_reduce(total)
        record["losses"] = total.tolist()
        record["weights"] = [p.detach().cpu().double().flatten().tolist() for p in model.parameters()]
        record["running_var"] = model[1].running_var.cpu().tolist()
        _save(out, rank, record)
        if device.type == "cuda":  # what NCCL says to two ranks on one GPU; after the results are saved
            try:
                nccl = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=20))
                probe = torch.ones(1, device=device)
                dist.all_reduce(probe, group=nccl)
                synchronize(device)
                record["nccl"] = f"NCCL ran two ranks on one GPU (sum {probe.item():g})"
            except Exception as error:  # noqa: BLE001 - the answer, whatever it is, is the finding
                record["nccl"] = f"NCCL refused two ranks on one GPU: {first_line(error)}"
            _save(out, rank, record)
        dist.barrier()
        if rank == 1:
            os._exit(0)  # killed: no goodbye to the group
        time.sleep(1)
        try:
            dist.all_reduce(torch.ones(1, device=device))
            record["killed_peer"] = "the collective with a dead peer returned"
        except Exception as error:  # noqa: BLE001
            classified = is_communication_error(error)
            record["killed_peer"] = (lost_contact_message(error, rank=0, timeout_s=30, launcher="torchrun")
                                     if classified else f"not classified as a lost peer: {first_line(error)}")
            record["killed_peer_classified"] = classified
        _save(out, rank, record)
    except Exception as error:  # noqa: BLE001
        record["error"] = "".join(traceback.format_exception(error))[-3000:]
        _save(out, rank, record)
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _spawn_two(worker, device: torch.device, timeout_s: float, *args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        store = str(Path(folder) / "store")
        context = mp.start_processes(worker, args=(str(device), store, folder, *args), nprocs=2, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout_s
        crashed = None
        while True:
            try:
                if context.join(timeout=0.5):
                    break
            except Exception as error:  # noqa: BLE001 - a rank raised (or the killed one's exit): read the records
                crashed = error
                break
            if time.monotonic() > deadline:
                break
        for process in context.processes:
            if process.is_alive():
                process.kill()
        records = []
        for rank in range(2):
            path = Path(folder, f"rank{rank}.json")
            records.append(json.loads(path.read_text()) if path.exists() else {})
        if crashed is not None and not any("killed_peer" in r for r in records):
            records[0].setdefault("error", first_line(crashed))
        return records


def two_processes(device: torch.device) -> int:
    from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d  # noqa: F401 - fail here, not in a child

    if device.type == "cuda":
        device = torch.device("cuda", 0)
    records = _spawn_two(_two_process_worker, device, min(120.0, time_left() - 3))
    for rank, record in enumerate(records):
        print(f"rank {rank}: {json.dumps({k: v for k, v in record.items() if k != 'weights'})[:3000]}", flush=True)
    errors = [r["error"] for r in records if "error" in r]
    if errors or not all("losses" in r for r in records):
        result(f"two processes on {device} over gloo did not finish: {(errors or ['no result'])[0].splitlines()[-1]}")
        return FAILED
    reference = _small_net(torch.nn.BatchNorm2d)
    expected = _train_steps(reference, reference, lambda step: _global_batch(step)[0],
                            lambda step: _global_batch(step)[1], 3, scale=1)
    loss_error = max(abs(a - b) for a, b in zip(records[0]["losses"], expected))
    weights = [torch.tensor(w) for w in records[0]["weights"]]
    weight_error = max(float((w - p.detach().double().flatten()).abs().max())
                       for w, p in zip(weights, reference.parameters()))
    same = records[0]["weights"] == records[1]["weights"]
    matches = loss_error < 1e-4 and weight_error < 1e-4 and same
    killed = records[0].get("killed_peer", "not reached")
    parts = [f"DDP + synchronized BN, 2 processes on {device} over gloo: 3 SGD steps against nn.BatchNorm2d on the "
             f"whole batch, loss diff {loss_error:.1e}, weight diff {weight_error:.1e}, ranks equal: {same}",
             records[0].get("nccl", "NCCL: not tried on a CPU"),
             f"killed peer: {killed}"]
    for part in parts:
        print(part, flush=True)
    ok = matches and records[0].get("killed_peer_classified") is True
    result("; ".join([parts[0], parts[1], "killed peer: the survivor's line is the lost-contact line" if ok
                      else f"killed peer: {killed[:200]}"]))
    return PASSED if ok else FAILED


# ------------------------------------------------------------------------------------------------ DataParallel
def dp_one_gpu(device: torch.device) -> int:
    """DataParallelWithCallback with two replicas on GPU 0, against nn.BatchNorm2d on the whole batch, in fp32
    and under bf16 autocast (the replica threads must keep the caller's dtype)."""
    from syncseg.engine.devices import autocast_for
    from syncseg.model.sync_batchnorm import DataParallelWithCallback, SynchronizedBatchNorm2d

    if device.type != "cuda":
        result("needs CUDA: DataParallel replicates only onto GPUs")
        return NOT_HERE
    sync = _small_net(SynchronizedBatchNorm2d).cuda()
    reference = _small_net(torch.nn.BatchNorm2d).cuda()
    try:
        model = DataParallelWithCallback(sync, device_ids=[0, 0])
        x, upstream = (t.cuda() for t in _global_batch(0))
        output = model(x)
        output.backward(upstream)
    except Exception as error:  # noqa: BLE001 - torch's refusal is the finding
        result(f"torch does not run two replicas on one GPU: {first_line(error)}")
        return NOT_HERE
    expected = reference(x)
    expected.backward(upstream)
    output_error = float((output - expected).abs().max())
    grad_error = max(float((p.grad - q.grad).abs().max()) for p, q in zip(sync.parameters(), reference.parameters()))
    with autocast_for(x.device, "bf16"):
        dtype = model(x).dtype
    ok = output_error < 1e-4 and grad_error < 1e-3 and dtype == torch.bfloat16
    result(f"2 replicas on GPU 0 against nn.BatchNorm2d: output diff {output_error:.1e}, grad diff {grad_error:.1e}; "
           f"under bf16 autocast the output is {dtype}")
    return PASSED if ok else FAILED


# ------------------------------------------------------------------------------------------------ torch.compile
def _compile_worker(rank: int, device_name: str, store: str, out: str, backend: str) -> None:
    import torch.distributed as dist

    from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

    device = torch.device(device_name)
    record: dict = {}
    _join(rank, store, timeout_s=300)  # the first compile of a rank can take minutes
    try:
        start = sum(SPLITS[:rank])
        local = slice(start, start + SPLITS[rank])
        x, upstream = (t[local].to(device) for t in _global_batch(0))
        explained = torch._dynamo.explain(_small_net(SynchronizedBatchNorm2d).to(device))(x)
        record["graphs"] = f"{explained.graph_count} graph(s), {explained.graph_break_count} break(s)"
        torch._dynamo.reset()
        eager = _small_net(SynchronizedBatchNorm2d).to(device)
        eager_out = eager(x)
        (eager_out * upstream).sum().backward()
        for name in ([backend, "aot_eager"] if backend != "aot_eager" else [backend]):
            model = _small_net(SynchronizedBatchNorm2d).to(device)
            began = time.monotonic()
            try:
                out_compiled = torch.compile(model, backend=name, fullgraph=True)(x)
                (out_compiled * upstream).sum().backward()
                synchronize(device)
            except Exception as error:  # noqa: BLE001 - recorded; the next backend is tried
                record[f"{name}_error"] = first_line(error)[:400]
                torch._dynamo.reset()
                continue
            record["backend"] = name
            record["seconds"] = round(time.monotonic() - began, 1)
            record["output_diff"] = float((out_compiled - eager_out).detach().abs().max())
            record["grad_diff"] = max(float((p.grad - q.grad).abs().max())
                                      for p, q in zip(model.parameters(), eager.parameters()))
            break
        _save(out, rank, record)
        dist.barrier()
    except Exception as error:  # noqa: BLE001
        record["error"] = "".join(traceback.format_exception(error))[-3000:]
        _save(out, rank, record)
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def compile_layers(device: torch.device, backend: str) -> int:
    compiler = next((shutil.which(name) for name in ("cc", "gcc", "clang") if shutil.which(name)), None)
    try:
        import triton  # noqa: F401

        triton_version = triton.__version__
    except Exception as error:  # noqa: BLE001
        triton_version = f"not importable ({first_line(error)})"
    environment = f"C compiler: {compiler or 'none'}; CC={os.environ.get('CC', '(unset)')}; Triton {triton_version}"
    print(environment, flush=True)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    records = _spawn_two(_compile_worker, device, min(400.0, time_left() - 3), backend)
    for rank, record in enumerate(records):
        print(f"rank {rank}: {json.dumps(record)[:3000]}", flush=True)
    record = records[0]
    if "error" in record or "backend" not in record:
        failures = "; ".join(f"{key}: {value}" for key, value in record.items() if key.endswith("_error"))
        result(f"{environment}; the layers did not compile: {failures or record.get('error', 'no result')[-300:]}")
        return FAILED
    fell_back = f" ({backend} failed: {record[backend + '_error']})" if record["backend"] != backend else ""
    ok = record["output_diff"] < 1e-4 and record["grad_diff"] < 1e-3 and record["graphs"].startswith("1 graph(s), 0")
    result(f"{environment}; 2 processes on {device}: {record['graphs']}, compiled with {record['backend']}{fell_back} "
           f"in {record['seconds']} s, output diff {record['output_diff']:.1e}, grad diff {record['grad_diff']:.1e}")
    return PASSED if ok and not fell_back else FAILED


# ------------------------------------------------------------------------------------------------ validation
def val_autotune(device: torch.device, count: int) -> int:
    """Whole-image validation of the demo's model over `count` images of distinct sizes, three ways, each on sizes
    of its own (cuDNN keeps what it autotuned for the process): autotuning every size (training's process-wide
    setting, before), no autotuning, and evaluate()'s rule (autotune a size when it comes back)."""
    from syncseg.engine.config import load_config
    from syncseg.engine.evaluate import evaluate
    from syncseg.engine.inference import predict_batch
    from syncseg.engine.samplers import build_eval_loader
    from syncseg.model.builder import build_model

    config = load_config("demo.yaml", ["model.channels_last=false"])
    model = build_model(config.model, 6).to(device).eval()
    base = 320 if device.type == "cuda" else 48

    def images(offset: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sizes = [(base + 8 * (3 * i + offset), base + 40 - 8 * (3 * i + offset) % 40) for i in range(count)]
        return [(torch.randint(0, 256, (3, h, w), dtype=torch.uint8), torch.zeros(h, w, dtype=torch.int64))
                for h, w in sizes]

    def predict_each(samples) -> None:
        with torch.inference_mode():
            for image, mask in samples:
                predict_batch(model, image.unsqueeze(0).to(device), num_classes=6, data_cfg=config.data,
                              eval_cfg=config.eval, output_size=tuple(mask.shape))

    saved = torch.backends.cudnn.benchmark
    timings = {}
    try:
        torch.backends.cudnn.benchmark = False
        predict_each(images(3)[:1])  # warm-up: CUDA context, cuDNN handles
        for label, offset, benchmark in (("autotuning every size", 0, True), ("no autotuning", 1, False),
                                         ("evaluate()'s rule", 2, True)):
            torch.backends.cudnn.benchmark = benchmark
            samples = images(offset)
            synchronize(device)
            start = time.perf_counter()
            if label == "evaluate()'s rule":
                evaluate(model, build_eval_loader(samples, batch_size=1), num_classes=6, device=device,
                         data_cfg=config.data, eval_cfg=config.eval, progress=False)
            else:
                predict_each(samples)
            synchronize(device)
            timings[label] = time.perf_counter() - start
    finally:
        torch.backends.cudnn.benchmark = saved
    result(f"{count} images of distinct sizes ~{base}x{base + 40} on {device}: "
           + ", ".join(f"{label} {seconds:.2f} s" for label, seconds in timings.items()))
    return PASSED


# ------------------------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_probes", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["unfuse", "sigterm", "bad-mask", "tf32", "two-processes", "dp-one-gpu",
                                          "compile", "val-autotune", "step", "step-norms", "host-syncs", "fused-grad"])
    parser.add_argument("checkpoint", nargs="?", help="unfuse: the checkpoint to rewrite")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--backend", default="inductor", help="compile: the torch.compile backend to try first")
    parser.add_argument("--images", type=int, default=12, help="val-autotune: images per way")
    parser.add_argument("--deadline", type=float, default=None, help="seconds the probe may take (see above)")
    argv = sys.argv[1:] if argv is None else argv
    # sigterm / bad-mask: train.py's own arguments (options among them) follow a "--"
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    if args.deadline is not None:
        _start_deadline(args.deadline, args.probe)
    device = torch.device(args.device)
    if device.type == "cuda" and args.probe not in ("unfuse", "sigterm", "bad-mask") and not torch.cuda.is_available():
        result("no CUDA device")
        return NOT_HERE
    try:
        if args.probe == "unfuse":
            if not args.checkpoint:
                parser.error("unfuse needs the checkpoint to rewrite")
            return unfuse(args.checkpoint)
        if args.probe == "sigterm":
            return sigterm(train_args)
        if args.probe == "bad-mask":
            return bad_mask(train_args)
        if args.probe == "tf32":
            return tf32(device)
        if args.probe == "two-processes":
            return two_processes(device)
        if args.probe == "dp-one-gpu":
            return dp_one_gpu(device)
        if args.probe == "compile":
            return compile_layers(device, args.backend)
        if args.probe in ("step", "step-norms", "host-syncs", "fused-grad"):
            from scripts.gpu_step_probes import PROBES

            return PROBES[args.probe](device)
        return val_autotune(device, args.images)
    except Exception as error:  # noqa: BLE001 - one line for the summary, the traceback for the log
        traceback.print_exc()
        result(f"the probe failed: {first_line(error)}")
        return FAILED


if __name__ == "__main__":
    # run from the importable module, not this __main__ copy: scripts.gpu_step_probes imports it, and its
    # deadline (time_left) and the workers that spawned processes load must be the same objects
    from scripts.gpu_probes import main as module_main

    sys.exit(module_main())
