"""benchmarks/common.py: interleaving, paired ratios, A/A-gated verdicts, the allocator re-exec, the summary."""
from __future__ import annotations

import json
import os

import pytest

from benchmarks import common, summary


def test_interleaving_follows_the_balanced_orders_and_averages_inner_calls():
    calls = []
    ticks = iter(range(1000))
    variants = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = common.time_interleaved(variants, 2, inner=2, warmup=1, clock=lambda: float(next(ticks)))
    first, second = common.balanced_orders(list("abc"))[:2]
    assert calls == list("abc") + [n for n in first for _ in range(2)] + [n for n in second for _ in range(2)]
    assert times == {name: [0.5, 0.5] for name in "abc"}  # one clock tick per sample of 2 calls


def test_no_garbage_collection_runs_inside_a_sample():
    import gc

    collections = []

    def on_gc(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    def make_garbage():
        assert not gc.isenabled()
        for _ in range(5000):  # reference cycles: enough to trigger a collection if the collector were on
            cycle = []
            cycle.append(cycle)

    # a full collection first: otherwise one that the allocations before this test made due (how many modules
    # the suite imported decides it) may land between two samples and look like the benchmark's own
    gc.collect()
    gc.callbacks.append(on_gc)
    try:
        sample_collections = []

        def timed():
            start = len(collections)
            make_garbage()
            sample_collections.append(len(collections) - start)

        common.time_interleaved({"a": timed}, 3, warmup=0)
    finally:
        gc.callbacks.remove(on_gc)
    assert sample_collections == [0, 0, 0]
    assert gc.isenabled()  # restored after the samples
    assert collections and max(collections) <= 1  # the young generations, between samples, only


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_orders_let_every_variant_follow_every_other_equally_often(n):
    names = [f"v{i}" for i in range(n)]
    orders = common.balanced_orders(names)
    assert all(sorted(order) == names for order in orders)
    follows = {}
    for order in orders:
        for before, after in zip(order, order[1:]):
            follows[before, after] = follows.get((before, after), 0) + 1
    # every ordered pair of distinct variants is adjacent, and all equally often (the twin of an A/A
    # control is not always right behind its original)
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1
    assert len(orders) == (n if n % 2 == 0 else 2 * n) or n == 1


def test_paired_ratios_report_median_and_spread():
    figure = common.paired([2.0, 3.0, 4.0, 10.0], [1.0, 1.0, 2.0, 1.0])
    assert figure["median"] == pytest.approx(2.5) and figure["min"] == 2.0 and figure["max"] == 10.0
    assert figure["pairs"] == 4 and figure["q1"] <= figure["median"] <= figure["q3"]


@pytest.mark.parametrize("value,control,higher,verdict", [
    (1.01, 1.0, False, "PASS"), (1.10, 1.0, False, "FAIL"), (1.01, 1.05, False, "NOISY"), (0.9, 0.979, False, "NOISY"),
    (3.5, 1.01, True, "PASS"), (2.5, 0.99, True, "FAIL"), (1.0, None, False, "PASS"),
])
def test_a_verdict_needs_the_a_a_control_within_two_percent(value, control, higher, verdict):
    record = common.judge("t", {"median": value}, target=1.03 if not higher else 3.0,
                          control=None if control is None else {"median": control}, higher_is_better=higher)
    assert record["verdict"] == verdict


def test_the_allocator_setting_is_applied_by_re_executing(monkeypatch):
    executed = []
    monkeypatch.setattr(os, "execve", lambda path, args, env: executed.append((args, env)))
    for name in common.STABLE_ALLOCATOR:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("BENCH_DEFAULT_ALLOCATOR", raising=False)
    common.stable_allocator("benchmarks.bench_x", ["--repeats", "3"])
    (args, env), = executed
    assert args[1:] == ["-m", "benchmarks.bench_x", "--repeats", "3"]
    assert all(env[name] == value for name, value in common.STABLE_ALLOCATOR.items())
    for name, value in common.STABLE_ALLOCATOR.items():
        monkeypatch.setenv(name, value)
    common.stable_allocator("benchmarks.bench_x", [])  # already set: no second exec
    monkeypatch.delenv(next(iter(common.STABLE_ALLOCATOR)))
    monkeypatch.setenv("BENCH_DEFAULT_ALLOCATOR", "1")
    common.stable_allocator("benchmarks.bench_x", [])  # glibc defaults asked for
    assert len(executed) == 1
    assert "raised" in common.environment()["allocator"] or "defaults" in common.environment()["allocator"]


def test_summary_prints_every_target_with_its_verdict(tmp_path, capsys):
    targets = [common.judge("speed", {"median": 1.2, "q1": 1.1, "q3": 1.3, "min": 1.0, "max": 1.4, "pairs": 9},
                            target=1.1, control={"median": 1.0}),
               common.judge("noisy", {"median": 1.0, "q1": 1, "q3": 1, "min": 1, "max": 1, "pairs": 9},
                            target=1.1, control={"median": 1.3})]
    path = tmp_path / "bench_x.json"
    path.write_text(json.dumps({"environment": {"allocator": "a"}, "targets": targets}))
    assert summary.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "speed" in out and "FAIL" in out and "NOISY" in out and "0 pass, 1 fail, 1 too noisy" in out


def test_config_parser_takes_config_output_and_overrides_in_any_order():
    parser = common.config_parser("bench_x", "Title line.\n\nMore.")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_intermixed_args(["train.iters=5", "--rounds", "7", "--config", "voc.yaml", "model.aux_loss=false"])
    assert (args.config, args.output, args.rounds) == ("voc.yaml", None, 7)
    assert args.overrides == ["train.iters=5", "model.aux_loss=false"]
    assert "results/bench_x.json" in parser.format_help() and parser.description == "Title line."
