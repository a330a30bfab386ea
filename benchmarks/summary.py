"""One table of every benchmark target: `python -m benchmarks.summary [results/*.json]`.

Reads the `targets` each benchmark wrote (benchmarks/common.py: figure, spread, A/A control, verdict)
and prints them with PASS / FAIL / NOISY (too noisy to judge: the A/A control was beyond 1.02).
Exit status 0 whatever the verdicts: the table is a report, not a test.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import RESULTS, format_spread

ORDER = ("bench_syncbn", "bench_model", "bench_data", "bench_eval", "bench_train", "bench_stop", "bench_optim",
         "bench_vs_plain", "bench_eval_vs_plain", "bench_runtimes", "bench_tracking",
         "bench_scene_predict")


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)] or \
        [RESULTS / f"{name}.json" for name in ORDER if (RESULTS / f"{name}.json").is_file()]
    rows = []
    for path in paths:
        record = json.loads(path.read_text())
        allocator = record.get("environment", {}).get("allocator", "?")
        for target in record.get("targets", []):
            rows.append((path.stem, target, allocator))
    if not rows:
        print("no benchmark results with targets found (run make bench)")
        return 0
    width = max(len(target["target"]) for _, target, _ in rows)
    print(f"{'target':<{width}}  {'goal':>8}  {'figure':>7}  {'A/A':>6}  {'verdict':<7}  spread")
    print("-" * (width + 80))
    for _, target, _ in rows:
        control = f"{target['control']['median']:.3f}" if target.get("control") else "-"
        print(f"{target['target']:<{width}}  {target['goal']:>8}  {target['figure']['median']:7.3f}  {control:>6}  "
              f"{target['verdict']:<7}  {format_spread(target['figure'])}")
    counts = {verdict: sum(1 for _, t, _ in rows if t["verdict"] == verdict) for verdict in ("PASS", "FAIL", "NOISY")}
    print(f"{counts['PASS']} pass, {counts['FAIL']} fail, {counts['NOISY']} too noisy to judge (A/A beyond 1.02); "
          f"allocator: {sorted({a for _, _, a in rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
