"""What every benchmark shares: a stable allocator, interleaved timing, paired ratios with their spread,
A/A controls, verdicts, and the JSON record `python -m benchmarks.summary` reads.

Why an A/A control: on a shared machine two timings of the same code can differ by more than a target's
margin. Each comparison "numerator / denominator" is therefore run beside "denominator copy /
denominator", an identical variant timed the same way; a verdict (PASS / FAIL) is given only when that
control's median is within 1.02 of 1.00, else the target reads NOISY ("too noisy to judge") with its
figures.

Why the allocator setting: glibc returns large freed blocks to the OS, so every fresh multi-megabyte
tensor pays page faults (about 9 ms for 32 MiB here) that dominate BatchNorm-sized work and vary from
run to run. `stable_allocator()` re-executes the benchmark with MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ raised, so freed memory stays in the process and is reused.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

STABLE_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967295"}
ALLOCATOR_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD",
                       "PYTORCH_CUDA_ALLOC_CONF")
CONTROL_TOLERANCE = 0.02
RESULTS = Path(__file__).resolve().parent / "results"


def stable_allocator(module: str, argv: Sequence[str]) -> None:
    """Re-execute `python -m module argv...` with STABLE_ALLOCATOR set, unless it is set already or
    BENCH_DEFAULT_ALLOCATOR=1 asks for glibc's defaults. Call it under `if __name__ == "__main__"` only:
    it replaces the running process."""
    if os.environ.get("BENCH_DEFAULT_ALLOCATOR") == "1":
        return
    if all(os.environ.get(name) == value for name, value in STABLE_ALLOCATOR.items()):
        return
    environment = {**os.environ, **STABLE_ALLOCATOR}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], environment)


def config_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The command line of a benchmark that runs a training config: --config, --output and KEY=VALUE
    overrides (parse with parse_intermixed_args); the benchmark adds its own options."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--config", default="demo.yaml", help="config name in configs/ or a YAML path")
    parser.add_argument("--output", default=None, help=f"JSON path (default benchmarks/results/{name}.json)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.batch_size=4")
    return parser


def cpu_bf16_flags() -> list[str]:
    """The bf16 flags of /proc/cpuinfo (avx512_bf16: AMD and Intel with native bf16; amx_bf16: Intel AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted({flag for flag in flags if flag in ("avx512_bf16", "amx_bf16")})


def environment(**extra: Any) -> dict[str, Any]:
    """The settings a reader needs to compare two runs (recorded in every JSON)."""
    import torch

    stable = all(os.environ.get(name) == value for name, value in STABLE_ALLOCATOR.items())
    return {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels torch runs (ATEN_CPU_CAPABILITY)
        "cpu_bf16": cpu_bf16_flags(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "allocator_env": {name: os.environ.get(name) for name in ALLOCATOR_VARIABLES},
        "allocator": "glibc, freed memory kept (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised)" if stable
        else "glibc defaults (large freed blocks return to the OS)",
        **extra,
    }


def balanced_orders(names: Sequence[str]) -> list[list[str]]:
    """A Williams design over `names`: a cycle of orders in which every variant runs once per order and
    every variant directly follows every other one equally often (n orders for n even, 2n for n odd).

    Why not "A B C, C B A, ...": there a variant's twin always runs right after it (warm caches, ranks in
    step), which biased A/A controls by 2-6% in one direction; rotations have the same flaw.
    """
    n = len(names)
    if n <= 1:
        return [list(names)]
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    rows = [[(value + shift) % n for value in first] for shift in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[names[i] for i in row] for row in rows]


def time_interleaved(variants: Mapping[str, Callable[[], Any]], repeats: int, *, inner: int = 1,
                     before: Callable[[], None] | None = None, after: Callable[[], None] | None = None,
                     clock: Callable[[], float] = time.perf_counter, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each variant, `repeats` samples each; a sample is the mean of `inner` calls.

    Every repetition runs every variant once, in the next order of `balanced_orders` (each variant follows
    each other one equally often over a cycle), so drift and neighbour effects hit all alike. `before` /
    `after` run around each sample outside the clock (a device synchronization, a barrier). Python's
    garbage collector runs between samples, never inside one (`quiet_gc`).
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    if after is not None:
        after()
    times: dict[str, list[float]] = {name: [] for name in names}
    orders = balanced_orders(names)
    for repetition in range(repeats):
        order = orders[repetition % len(orders)]
        for name in order:
            with quiet_gc():
                if before is not None:
                    before()
                start = clock()
                for _ in range(inner):
                    variants[name]()
                if after is not None:
                    after()
                times[name].append((clock() - start) / inner)
    return times


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect the young generations now, then keep the collector off until the block ends (as timeit
    does): a collection landing inside one sample and not its twin is noise. Only generations 0 and 1
    are collected (microseconds); a full collection takes ~200 ms with torch's ~400k objects."""
    enabled = gc.isenabled()
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def paired(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min and max of the per-repetition ratios numerator[i] / denominator[i]."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    q1, q3 = _quartiles(ratios)
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "min": min(ratios), "max": max(ratios),
            "pairs": len(ratios)}


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median and quartiles of raw values (times scaled by `scale`, e.g. 1000 for ms)."""
    q1, q3 = _quartiles(values)
    return {"median": statistics.median(values) * scale, "q1": q1 * scale, "q3": q3 * scale, "n": len(values)}


def judge(name: str, figure: Mapping[str, float], *, target: float, control: Mapping[str, float] | None,
          higher_is_better: bool = False, unit: str = "x") -> dict[str, Any]:
    """A target's record: its figure (median and spread), the A/A control and the verdict.

    `control` None means the figure is not a timing (e.g. saved bytes), so it needs no control.
    """
    control_ok = control is None or abs(control["median"] - 1.0) <= CONTROL_TOLERANCE
    met = figure["median"] >= target if higher_is_better else figure["median"] <= target
    verdict = ("PASS" if met else "FAIL") if control_ok else "NOISY"
    return {"target": name, "goal": f"{'>=' if higher_is_better else '<='} {target:g}{unit}", "figure": dict(figure),
            "control": dict(control) if control is not None else None, "verdict": verdict}


def format_spread(figure: Mapping[str, float]) -> str:
    if "q1" in figure:
        return f"IQR {figure['q1']:.3f}-{figure['q3']:.3f}, min-max {figure['min']:.3f}-{figure['max']:.3f}, " \
               f"{figure['pairs']} pairs"
    return "exact"


def print_targets(targets: Sequence[Mapping[str, Any]]) -> None:
    """One line a target: figure, spread, A/A control, verdict (NOISY: too noisy to judge)."""
    width = max(len(t["target"]) for t in targets)
    print(f"\n{'target':<{width}}  {'goal':>8}  {'figure':>7}  {'A/A':>6}  verdict  spread")
    for t in targets:
        control = f"{t['control']['median']:.3f}" if t["control"] else "-"
        verdict = t["verdict"] if t["verdict"] != "NOISY" else "NOISY (too noisy to judge: A/A beyond 1.02)"
        print(f"{t['target']:<{width}}  {t['goal']:>8}  {t['figure']['median']:7.3f}  {control:>6}  {verdict}  "
              f"{format_spread(t['figure'])}")


def versus_plain(rows: Sequence[Mapping[str, float]], names: Sequence[str], label: str, *,
                 extra: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The table and targets of a product-against-plain-loop benchmark (bench_vs_plain, bench_eval_vs_plain):
    `rows` hold images/s per variant and round (syncseg_fp32, syncseg_auto, plain, plain_copy, ...). Prints
    each variant (in the order of `names`)'s median and its median paired ratio to `plain` (plus `extra[name]`'s values per variant),
    then the two targets (fp32 and auto >= 1.10x plain, A/A: plain_copy / plain); returns (medians, targets)."""
    extra = extra or {}
    medians = {name: statistics.median(row[name] for row in rows) for name in names}
    print(f"{'variant':<17} {'img/s':>7} {'x plain':>8}" + "".join(f"  {key}" for key in extra))
    for name in names:
        ratio = statistics.median(row[name] / row["plain"] for row in rows)
        print(f"{name:<17} {medians[name]:7.3f} {ratio:8.3f}" + "".join(f"  {values[name]:.6f}" for values in extra.values()))

    def column(name: str) -> list[float]:
        return [row[name] for row in rows]

    control = paired(column("plain_copy"), column("plain"))
    targets = [judge(f"{label}: syncseg {kind} / plain", paired(column(f"syncseg_{kind}"), column("plain")),
                     target=1.10, control=control, higher_is_better=True) for kind in ("fp32", "auto")]
    return medians, targets


def write_record(name: str, output: str | None, payload: Mapping[str, Any]) -> Path:
    """Write the benchmark's JSON (its `targets` list is what benchmarks.summary reads)."""
    path = Path(output) if output else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))
    print(f"wrote {path}")
    return path
