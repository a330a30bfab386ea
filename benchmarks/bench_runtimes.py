"""Prediction speed and int8 accuracy of the runtimes (issue 51): PyTorch eager against ONNX Runtime and
OpenVINO, fp32, bf16 and int8, through what users call (syncseg.load_model(..., runtime=...).predict_logits:
the normalization, the forward pass, the upsampling), in one process.

Variants, timed interleaved (benchmarks/common.py) on a 375 x 500 image (VOC's usual size) and a
1024 x 1024 tile, eval.mode=whole, each runtime at its default thread count (all cores):
  torch_fp32        PyTorch eager, eval.amp=off (the denominator of every ratio)
  torch_fp32_copy   the same again: the A/A control
  torch_fp32_nchw   PyTorch eager fp32 with model.channels_last=false: the contiguous layout a plain PyTorch
                    loop runs (and syncseg's own default on AVX2-only CPUs, where channels-last is slower)
  torch_auto        PyTorch eager, eval.amp=auto (bf16 in channels-last on CPUs with AVX512_BF16/AMX)
  ort_fp32          ONNX Runtime (CPU provider, all graph optimizations) on the fp32 export
  ov_fp32           OpenVINO, inference precision hint f32
  ov_auto           OpenVINO at eval.amp=auto: bf16 on native-bf16 CPUs, else f32
  ort_int8          ONNX Runtime on the int8 QDQ export (export.py --int8)
  ov_int8           OpenVINO on the same int8 file
Targets: the fastest fp32 runtime >= 1.5x torch_fp32 and the fastest int8 runtime >= 2.5x torch_fp32 at
each size; int8's validation mIoU within 1.0 point of the fp32 export's on the demo's validation set and on
the real-texture scene of benchmarks/small_data.py (held-out regions of brick, grass and gravel photographs),
each model trained here first (--demo-iters, --scene-iters; or --checkpoint for the demo one).

The CPU kind is printed and recorded (AMX, AVX512_BF16, AVX-512, AVX2; VNNI for int8). On a CPU without
native bf16 the *_auto rows run fp32 (emulated bf16 is ~14x slower), so every target is judged on fp32 or
int8 rows only and holds on the fp32 path.

    python -m benchmarks.bench_runtimes [--rounds 18] [--checkpoint best.pt] [--demo-iters 200]
                                        [--scene-iters 200] [--backbone resnet18] [--isa avx2] [--output PATH]

`--isa avx2` times the AVX2 path on an AVX-512 machine: PyTorch and OpenVINO capped at AVX2 kernels
through ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA (set before torch starts), the bf16 rows left out;
ONNX Runtime's MLAS has no such switch, so its rows keep their AVX-512 kernels and are not judged.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


from benchmarks.common import environment, judge, paired, print_targets, stable_allocator, time_interleaved
from benchmarks.common import write_record

VARIANTS = {  # name: (runtime, eval.amp, int8 file)
    "torch_fp32": ("torch", "off", False), "torch_fp32_copy": ("torch", "off", False),
    "torch_fp32_nchw": ("torch", "off", False),
    "torch_auto": ("torch", "auto", False), "ort_fp32": ("onnxruntime", "off", False),
    "ov_fp32": ("openvino", "off", False), "ov_auto": ("openvino", "auto", False),
    "ort_int8": ("onnxruntime", "off", True), "ov_int8": ("openvino", "off", True),
}
FP32 = ("ort_fp32", "ov_fp32")
INT8 = ("ort_int8", "ov_int8")
# --isa avx2: oneDNN (PyTorch's convolutions and OpenVINO's CPU plugin) and PyTorch's own kernels capped at
# AVX2; ONNX Runtime's MLAS picks its kernels by cpuid and has no such switch
FORCED_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SIZES = ((375, 500), (1024, 1024))


def cpu_kind() -> tuple[str, list[str]]:
    """("AMX" | "AVX512_BF16" | "AVX-512" | "AVX2" | "other", the flags that decided it and int8's VNNI)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = set(next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), []))
    except OSError:
        flags = set()
    kind = ("AMX" if "amx_bf16" in flags else "AVX512_BF16" if "avx512_bf16" in flags else
            "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other")
    return kind, sorted(flags & {"amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2"})


def forced_avx2() -> bool:
    return all(os.environ.get(name) == value for name, value in FORCED_AVX2.items())


def train_demo(run_dir: Path, iters: int, backbone: str) -> Path:
    import syncseg

    precision = ["train.amp=off"] if forced_avx2() else []  # bf16 capped at AVX2 is emulated, ~14x slower
    overrides = [*precision, f"train.iters={iters}", f"train.val_interval={iters}", f"train.ckpt_interval={iters}",
                 "train.num_vis_images=0", f"model.backbone={backbone}", f"output_dir={run_dir}"]
    start = time.perf_counter()
    syncseg.train("demo.yaml", overrides, resume=None, overwrite=True, gpus="cpu", progress=False)
    print(f"trained demo.yaml for {iters} iterations in {time.perf_counter() - start:.0f} s")
    return run_dir / "best.pt"


def train_scene(root: Path, iters: int) -> Path:
    from benchmarks import small_data

    scene = small_data.build_scene()
    small_data.write_folder(scene, root / "data")
    baseline = small_data.nearest_centroid(scene)
    result = small_data.train_config("small_data.yaml", root / "data", root / "run",
                                     [f"train.iters={iters}", f"train.val_interval={iters}", "train.num_vis_images=0"])
    print(f"trained small_data.yaml on the texture scene for {iters} iterations in {result['seconds']:.0f} s: val "
          f"mIoU {result['miou']:.4f} (per-pixel nearest-centroid baseline {baseline['miou']:.4f})")
    return root / "run" / "best.pt"


def int8_of(checkpoint: Path, calibrate: int):
    """The fp32 export (the runtime cache), its int8 file and the Comparison on the checkpoint's val split."""
    import syncseg
    from syncseg.engine.int8 import calibration_inputs, compare_miou, quantize_onnx

    predictor = syncseg.load_model(checkpoint, runtime="onnxruntime")
    fp32 = predictor.model.path
    int8 = checkpoint.with_name(f"{checkpoint.stem}.int8.onnx")
    calibrate = min(calibrate, _train_size(predictor.config))
    quantize_onnx(fp32, int8, calibration_inputs(predictor.config, len(predictor.classes), calibrate))
    return fp32, int8, compare_miou(predictor.config, predictor.classes, fp32, int8), calibrate


def _train_size(config) -> int:
    from syncseg.data import build_dataset

    return len(build_dataset(config.data, config.data.train_split, train=False))


def bench_speed(checkpoint: Path, int8: Path, rounds: int) -> dict:
    import syncseg

    predictors = {}
    capped = forced_avx2()
    for name, (runtime, amp, quantized) in VARIANTS.items():
        if capped and amp == "auto":  # would run bf16 emulated on AVX2 kernels; auto means fp32 on such CPUs
            continue
        keywords = {"runtime": runtime} if runtime == "torch" else {
            "runtime": runtime, "exported": int8 if quantized else None}
        layout = ["model.channels_last=false"] if name.endswith("_nchw") else []
        predictors[name] = syncseg.load_model(checkpoint, overrides=[f"eval.amp={amp}", "eval.mode=whole",
                                                                     "data.base_size=0", *layout], **keywords)
    precisions = {name: getattr(p.model, "precision", p.config.eval.amp) for name, p in predictors.items()}
    results = {}
    for height, width in SIZES:
        image = syncseg.demo_image(3, size=max(height, width))[:height, :width]  # shapes as the model learned them
        reference = predictors["torch_fp32"].predict(image)
        agreement = {name: float((predictor.predict(image) == reference).mean())
                     for name, predictor in predictors.items()}
        variants = {name: (lambda p=predictor: p.predict_logits(image)) for name, predictor in predictors.items()}
        times = time_interleaved(variants, rounds)
        base = times["torch_fp32"]
        rows = {name: {"images_per_s": 1 / statistics.median(values), "median_ms": 1000 * statistics.median(values),
                       "speedup": paired(base, values), "precision": precisions[name],
                       "pixels_as_torch_fp32": agreement[name]} for name, values in times.items()}
        control = paired(times["torch_fp32_copy"], base)
        judged = (lambda names: names) if not capped else (lambda names: [n for n in names if n.startswith("ov_")])
        fastest_fp32 = max(judged(FP32), key=lambda name: rows[name]["speedup"]["median"])
        fastest_int8 = max(judged(INT8), key=lambda name: rows[name]["speedup"]["median"])
        size = f"{height}x{width}"
        print(f"\n{size} (eval.mode=whole), {rounds} interleaved rounds")
        print(f"{'variant':<16} {'precision':>9} {'img/s':>7} {'ms':>7} {'x torch fp32':>12}  {'IQR':>11}  "
              f"{'same class as torch fp32':>24}")
        for name, row in rows.items():
            speed = row["speedup"]
            uncapped = "  (not capped: AVX-512 kernels)" if capped and name.startswith("ort_") else ""
            print(f"{name:<16} {row['precision']:>9} {row['images_per_s']:7.2f} {row['median_ms']:7.1f} "
                  f"{speed['median']:12.2f}  {speed['q1']:5.2f}-{speed['q3']:<5.2f}  "
                  f"{100 * row['pixels_as_torch_fp32']:23.3f}%{uncapped}")
        targets = [judge(f"runtimes {size}: fastest fp32 ({fastest_fp32}) / torch eager fp32",
                         rows[fastest_fp32]["speedup"], target=1.5, control=control, higher_is_better=True),
                   judge(f"runtimes {size}: fastest int8 ({fastest_int8}) / torch eager fp32",
                         rows[fastest_int8]["speedup"], target=2.5, control=control, higher_is_better=True)]
        results[size] = {"variants": rows, "control": control, "targets": targets}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=18, help="interleaved rounds per size (18 make one balanced "
                                                                "cycle of the 9 variants)")
    parser.add_argument("--checkpoint", help="a demo.yaml best.pt to time and quantize (default: train one)")
    parser.add_argument("--demo-iters", type=int, default=200, help="iterations of the demo model trained here")
    parser.add_argument("--scene-iters", type=int, default=200,
                        help="iterations of small_data.yaml on the texture scene (0: skip the real-set figure)")
    parser.add_argument("--backbone", default="resnet18", help="the demo model's backbone (default resnet18)")
    parser.add_argument("--calibrate", type=int, default=32, help="int8 calibration images (as export.py --int8)")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: cap PyTorch and OpenVINO at AVX2 kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA; "
                             "ONNX Runtime cannot be capped, its rows are printed but not judged), no bf16 rows, "
                             "no accuracy figures (the same arithmetic); writes bench_runtimes_avx2.json")
    parser.add_argument("--output", help="JSON path (default benchmarks/results/bench_runtimes.json)")
    args = parser.parse_args(argv)
    if args.isa == "avx2" and not forced_avx2():
        raise SystemExit("--isa avx2 must be set before torch starts: run python -m benchmarks.bench_runtimes --isa avx2")
    import onnxruntime
    import openvino

    kind, flags = cpu_kind()
    if forced_avx2():
        kind = f"AVX2 forced on {kind} (PyTorch and OpenVINO; ONNX Runtime uncapped)"
        args.scene_iters = 0
    print(f"CPU kind {kind} (flags: {', '.join(flags) or 'none of interest'}); onnxruntime {onnxruntime.__version__}, "
          f"openvino {openvino.__version__}")
    with tempfile.TemporaryDirectory(prefix="bench-runtimes-") as folder:
        checkpoint = Path(args.checkpoint) if args.checkpoint else train_demo(Path(folder) / "demo", args.demo_iters,
                                                                              args.backbone)
        accuracy, targets = {}, []
        _, int8, comparison, used = int8_of(checkpoint, args.calibrate)
        print(f"demo int8 ({used} calibration images): {comparison.describe()}")
        if not forced_avx2():
            accuracy["demo"] = {**vars(comparison), "drop_points": comparison.drop_points, "calibration_images": used}
            targets.append(judge("int8 mIoU drop on the demo's validation set (points)",
                                 {"median": comparison.drop_points}, target=1.0, control=None, unit=""))
        if args.scene_iters > 0:
            scene_checkpoint = train_scene(Path(folder) / "scene", args.scene_iters)
            _, _, scene, scene_used = int8_of(scene_checkpoint, args.calibrate)
            accuracy["texture_scene"] = {**vars(scene), "drop_points": scene.drop_points,
                                         "calibration_images": scene_used}
            print(f"texture scene int8 ({scene_used} calibration images): {scene.describe()}")
            targets.append(judge("int8 mIoU drop on the texture scene's held-out regions (points)",
                                 {"median": scene.drop_points}, target=1.0, control=None, unit=""))
        speed = bench_speed(checkpoint, int8, args.rounds)
    targets = [target for size in speed.values() for target in size["targets"]] + targets
    print_targets(targets)
    write_record("bench_runtimes_avx2" if forced_avx2() else "bench_runtimes", args.output, {
        "environment": environment(cpu_kind=kind, cpu_flags=flags, onnxruntime=onnxruntime.__version__,
                                   openvino=openvino.__version__),
        "model": f"demo.yaml (deeplabv3plus/{args.backbone}, 6 classes)", "accuracy": accuracy, "speed": speed,
        "targets": targets})
    return 0


if __name__ == "__main__":
    if "--isa=avx2" in sys.argv or any(a == "--isa" and b == "avx2" for a, b in zip(sys.argv, sys.argv[1:])):
        os.environ.update(FORCED_AVX2)  # before torch is imported (this module imports it lazily)
    stable_allocator("benchmarks.bench_runtimes", sys.argv[1:])
    sys.exit(main())
