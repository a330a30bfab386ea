#!/usr/bin/env bash
# GPU checks for a borrowed GPU machine whose image ships its own torch (docs/maintainers.md "GPU check"): what one
# GPU can show, the most informative first: every precision path in short trainings (fp16 with a GradScaler and
# the fused optimizer resumed from an unfused checkpoint, bf16 in channels-last, fp32 without TF32 stopped by
# SIGTERM), a bad mask value, two processes and two DataParallel replicas on the one GPU, the synchronized
# layers compiled, validation of varied sizes with and without cuDNN autotuning, every CUDA test, then the CUDA
# benchmarks; bounded in time (7.5 minutes in all) and in the files it leaves (the 8 named in the usage).
# Written for the image as it is: the runtime requirements it lacks (albumentations and its closure) are
# installed offline from the wheels that scripts/gpu_wheels.py downloaded beforehand; each step runs in a
# process of its own under `timeout`, so an import error, a crash or a hang costs that step alone. The Python
# steps are scripts/gpu_probes.py's subcommands.
set -uo pipefail

usage() {
  cat <<'EOF_USAGE'
usage: scripts/gpu_check.sh OUTPUT_DIR [--dry-run] [--wheels DIR] [--steps STEP,STEP...]

Runs, in this order, each step under its own timeout and all within 7.5 minutes (a step that fails or times
out is recorded and the next one runs; the steps the time does not reach are recorded as not run):
  environment   date, nvidia-smi, Python, torch and its CUDA, the C compiler Triton would use, pip list
  deps          imports the runtime requirements; when one fails, installs the wheels in DIR offline
                (pip --no-index --no-deps --target) into a private temporary folder put on PYTHONPATH
  train_fp16_resume
                10 iterations of the demo on GPU 0 in fp16 with a GradScaler and the fused AdamW, its last.pt
                rewritten as the unfused optimizer saved it (gpu_probes unfuse), resumed to 20
  train_bf16_channels_last
                20 iterations with train.amp=auto and model.channels_last=auto (bf16 in channels-last on an
                Ampere or newer GPU); the log's precision and layout lines
  train_off_sigterm
                train.amp=off (full fp32, TF32 off) stopped by SIGTERM after its first logged step: expects
                exit 143 and the stop line (gpu_probes sigterm)
  train_ddp2    a 2-process torchrun (NCCL); skipped with fewer than 2 GPUs
  tf32          fp32 convolution and matmul, amp off against amp tf32: error against float64 and time
  bad_mask      a mask value outside the classes: expects exit 2 and the one-line error, not a device-side
                assert (gpu_probes bad-mask)
  two_processes_one_gpu
                DDP with synchronized BN in two processes on GPU 0 over gloo (NCCL refuses two ranks on one
                GPU; its answer is recorded) against nn.BatchNorm2d, then a killed peer: the survivor's
                lost-contact line
  dp_one_gpu    DataParallelWithCallback with two replicas on GPU 0, fp32 and bf16 autocast, or why torch
                does not build them
  compile_syncbn
                the synchronized layers compiled (inductor, else aot_eager) in two processes on GPU 0, and
                whether a C compiler and Triton are there
  val_autotune  whole-image validation of 12 sizes: cuDNN autotuning every size, none, and evaluate()'s rule
  cuda_tests    every test file that declares CUDA tests, one pytest run per file (-m cuda)
  bench_cuda    benchmarks.bench_cuda: SyncBN against torch's layers, training images/s and memory
  bench_syncbn  benchmarks.bench_syncbn --device cuda (its table in benchmarks.txt)
Writes exactly these files in OUTPUT_DIR (created if needed; a relative path is taken from where the
script was started), each as soon as its step ends:
  summary.txt          one line a step: STATUS SECONDS STEP DETAIL (PASS, FAIL, TIMEOUT, SKIPPED)
  environment.txt      the environment and the deps step's log
  train.txt            the training logs (train_*, bad_mask)
  train_metrics.json   each training's status and its metrics.jsonl records (run folders and
                       checkpoints stay in a temporary folder, deleted at the end)
  probes.txt           the output of tf32, two_processes_one_gpu, dp_one_gpu, compile_syncbn, val_autotune
  cuda_tests.txt       the pytest output of every CUDA test file
  benchmarks.txt       the benchmarks' output
  bench_cuda.json      bench_cuda's record, with the step's status
Options:
  --steps LIST   run only these steps (comma-separated names from the list above; `cuda_tests` stands for
                 every CUDA test file); environment and deps always run, the others are recorded as
                 SKIPPED "not selected". To rerun what failed after a fix without spending the device
                 time on the rest, e.g. --steps train_fp16_resume,compile_syncbn
  --wheels DIR   wheels for the deps step (default: .gpu_wheels in the repository root, made by
                 `python scripts/gpu_wheels.py` where PyPI is reachable; the device tool copies it
                 only when the call names it: carry=['.gpu_wheels'])
  --dry-run      for a CPU machine: runs the same steps' plumbing (environment, deps with its install,
                 the fp16 resume as a 1-iteration CPU run in fp32, its unfuse and its resume, the SIGTERM
                 and bad-mask runs on the CPU, each probe on tiny CPU shapes, each CUDA test file, whose
                 tests skip themselves, bench_cuda on tiny CPU shapes, `--help` of bench_syncbn) and
                 records each GPU step as SKIPPED with why, writing the same files. To rehearse the GPU
                 image here (its missing packages hidden, installed from wheels for this machine's Python,
                 e.g. 3.11):
                   python scripts/gpu_wheels.py --python-version 3.11 /tmp/wheels311
                   PYTHONPATH=$PWD/scripts/gpu_image scripts/gpu_check.sh --dry-run --wheels /tmp/wheels311 OUT
Python: $PYTHON, else .venv/bin/python when it exists, else python3 (the GPU image's own).
GPU_CHECK_SECONDS: the time for all steps (default 450); a step never runs past it.
Exit status: 0 when no step failed or timed out, 1 otherwise, 2 on a usage error.
EOF_USAGE
}

dry_run=0
wheels=""
out=""
steps=""
ALL_STEPS="environment deps train_fp16_resume train_bf16_channels_last train_off_sigterm train_ddp2 tf32 bad_mask
two_processes_one_gpu dp_one_gpu compile_syncbn val_autotune cuda_tests bench_cuda bench_syncbn"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1 ;;
    --wheels)
      if [ $# -lt 2 ]; then echo "gpu_check.sh: --wheels needs a DIR" >&2; usage >&2; exit 2; fi
      wheels=$2; shift ;;
    --wheels=*) wheels=${1#--wheels=} ;;
    --steps)
      if [ $# -lt 2 ]; then echo "gpu_check.sh: --steps needs a LIST" >&2; usage >&2; exit 2; fi
      steps=$2; shift ;;
    --steps=*) steps=${1#--steps=} ;;
    -*) echo "gpu_check.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    *)
      if [ -n "$out" ]; then echo "gpu_check.sh: one OUTPUT_DIR expected, got '$out' and '$1'" >&2; usage >&2; exit 2; fi
      out=$1 ;;
  esac
  shift
done
if [ -z "$out" ]; then usage >&2; exit 2; fi
if [ -n "$steps" ]; then
  for step in ${steps//,/ }; do
    case " $(echo $ALL_STEPS) " in
      *" $step "*) ;;
      *) echo "gpu_check.sh: --steps: unknown step '$step'; the steps: $(echo $ALL_STEPS | tr ' ' ',')" >&2; exit 2 ;;
    esac
  done
fi

# Paths given relative to where the script was started are resolved before the cd to the repository root.
mkdir -p "$out" || { echo "gpu_check.sh: cannot create OUTPUT_DIR '$out'" >&2; exit 2; }
out=$(cd "$out" && pwd)
if [ -n "$wheels" ]; then
  case $wheels in /*) ;; *) wheels=$PWD/$wheels ;; esac
fi
py=${PYTHON:-}
case $py in */*) py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py") ;; esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2
wheels=${wheels:-$root/.gpu_wheels}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=$root/.venv/bin/python; else py=python3; fi
fi

# nothing is installed in the GPU image: the checkout itself is the project's import root (pyproject's
# editable install does this on our machines)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NO_ALBUMENTATIONS_UPDATE=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

TOTAL_BUDGET=${GPU_CHECK_SECONDS:-450}  # seconds for all steps: 7.5 minutes, so the whole check ends within 8
deadline=$((SECONDS + TOTAL_BUDGET))
status=0
counts_pass=0 counts_fail=0 counts_skip=0

summary=$out/summary.txt
env_log=$out/environment.txt
train_log=$out/train.txt
metrics_json=$out/train_metrics.json
probes_log=$out/probes.txt
tests_log=$out/cuda_tests.txt
bench_log=$out/benchmarks.txt
cuda_json=$out/bench_cuda.json
syncbn_json=$work/bench_syncbn_cuda.json  # its table is in benchmarks.txt; the JSON stays behind (8 files)
# Every file exists from the start, so a step that dies leaves the same file set behind.
for file in "$env_log" "$train_log" "$probes_log" "$tests_log" "$bench_log"; do : > "$file"; done
echo '{}' > "$metrics_json"
rm -f "$cuda_json"
{
  echo "gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC')$([ $dry_run = 1 ] && echo ', DRY RUN (no GPU steps)'); python: $py; wheels: $wheels$([ -n "$steps" ] && echo "; steps: $steps")"
  printf '%-7s %5s  %-44s %s\n' STATUS TIME STEP DETAIL
} > "$summary"

# record STATUS SECONDS STEP DETAIL: one summary line, written at once, echoed for the console.
record() {
  local line
  line=$(printf '%-7s %4ss  %-44s %s' "$1" "$2" "$3" "$4")
  echo "$line" >> "$summary"
  echo "gpu_check: $line"
  case $1 in
    PASS) counts_pass=$((counts_pass + 1)) ;;
    SKIPPED) counts_skip=$((counts_skip + 1)) ;;
    *) counts_fail=$((counts_fail + 1)); status=1 ;;
  esac
}

# bounded BUDGET LOG COMMAND...: runs COMMAND with its output appended to LOG, under `timeout`, for at
# most BUDGET seconds and never past the deadline. Sets rc (124: timed out, -1: not run, no time left), took
# (seconds) and limit (the timeout used).
bounded() {
  local budget=$1 log=$2
  shift 2
  limit=$((deadline - SECONDS))
  if [ "$limit" -gt "$budget" ]; then limit=$budget; fi
  took=0
  if [ "$limit" -lt 10 ]; then
    rc=-1
    echo "=== not run, the ${TOTAL_BUDGET} s budget is spent: $*" >> "$log"
    return
  fi
  echo "=== $* (timeout ${limit} s)" >> "$log"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1 < /dev/null
  rc=$?
  took=$((SECONDS - start))
  if [ "$rc" -eq 137 ]; then rc=124; fi
  echo "=== exit status $rc after ${took} s" >> "$log"
}

# selected STEP: whether --steps leaves STEP to run (all do without --steps). unselected STEP: its summary line.
unselected_reason="not selected (--steps $steps)"
selected() { [ -z "$steps" ] || case ",$steps," in *",$1,"*) true ;; *) false ;; esac; }
unselected() { record SKIPPED 0 "$1" "$unselected_reason"; }

# verdict STEP DETAIL [DRY_REASON]: the summary line for the last `bounded` run. In a dry run a command
# that succeeded stands in for the GPU step, which is SKIPPED with DRY_REASON.
verdict() {
  local step=$1 detail=$2 dry_reason=${3:-}
  case $rc in
    0) if [ $dry_run = 1 ] && [ -n "$dry_reason" ]; then record SKIPPED "$took" "$step" "dry run: $dry_reason"
       else record PASS "$took" "$step" "$detail"; fi ;;
    124) record TIMEOUT "$took" "$step" "stopped after ${limit} s${detail:+; $detail}" ;;
    -1) record SKIPPED 0 "$step" "not run: the ${TOTAL_BUDGET} s budget of all steps is spent" ;;
    *) record FAIL "$took" "$step" "exit status $rc${detail:+; $detail}" ;;
  esac
}

# note_json FILE: adds the last `bounded` run's outcome to a benchmark's JSON (a record of its own when the
# benchmark wrote none or an unreadable one), so each JSON says how its step ended.
note_json() {
  "$py" - "$1" "$rc" "$took" "$dry_run" <<'EOF_PY' || echo "{\"gpu_check\": {\"exit_status\": $rc}}" > "$1"
import json, sys
from pathlib import Path
path, rc, took, dry_run = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
try:
    record = json.loads(path.read_text())
except (OSError, ValueError):
    record = {}
outcome = {0: "done", 124: "timed out", -1: "not run: the time budget was spent",
           -3: "not run: not selected (--steps)"}.get(rc, f"failed ({rc})")
record["gpu_check"] = {"exit_status": rc, "outcome": outcome, "seconds": took, "dry_run": dry_run}
path.write_text(json.dumps(record, indent=2))
EOF_PY
}

# add_metrics NAME RUN_DIR [NOTE]: the run's metrics.jsonl records (not its checkpoints) into
# train_metrics.json under NAME, with how the last `bounded` run ended (or NOTE, when it did not run) and
# the run folder's file list; prints the last validation's mIoU for the summary line.
add_metrics() {
  "$py" - "$metrics_json" "$1" "$2" "${3:-}" "$rc" "$took" "$dry_run" <<'EOF_PY'
import json, sys
from pathlib import Path
path, name, run_dir, note, rc, took, dry_run = sys.argv[1:]
path, run_dir = Path(path), Path(run_dir)
data = json.loads(path.read_text())
if note:
    entry = {"outcome": "not run", "note": note}
else:
    outcome = {"0": "done", "124": "timed out", "-1": "not run: the time budget was spent"}.get(rc, f"failed ({rc})")
    entry = {"outcome": outcome, "exit_status": int(rc), "seconds": int(took), "dry_run": dry_run == "1"}
metrics = run_dir / "metrics.jsonl"
if metrics.exists():
    records = []
    for line in metrics.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a torn last line (the run was killed while writing it)
            records.append({"unreadable_line": line[:200]})
    entry["metrics"] = records
    val = [r for r in records if r.get("type") == "val" and "miou" in r]
    if val:
        print(f"val mIoU {val[-1]['miou']:.4f} at iteration {val[-1].get('iteration')}")
if run_dir.is_dir():
    entry["run_files"] = {str(p.relative_to(run_dir)): p.stat().st_size for p in sorted(run_dir.rglob("*")) if p.is_file()}
data[name] = entry
path.write_text(json.dumps(data, indent=2))
EOF_PY
}

# ---------------------------------------------------------------------------------------------- environment
env_start=$SECONDS
gpus=0 torch_summary=""
{
  echo "host: $(uname -a)"
  echo "started in: $root; OUTPUT_DIR: $out; work folder: $work"
  echo "--- nvidia-smi"
} >> "$env_log"
if command -v nvidia-smi > /dev/null; then timeout 30 nvidia-smi >> "$env_log" 2>&1; else echo "nvidia-smi: not found" >> "$env_log"; fi
echo "--- python and torch" >> "$env_log"
bounded 60 "$env_log" "$py" -c 'import platform, sys, torch
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = (": " + ", ".join(torch.cuda.get_device_name(i) for i in range(count))) if count else ""
print(f"torch_summary: torch {torch.__version__}, CUDA {torch.version.cuda}, {count} GPU(s){names}, "
      f"Python {platform.python_version()} ({sys.executable})")
print(f"gpu_count: {count}")'
if [ "$rc" -eq 0 ]; then
  torch_summary=$(grep '^torch_summary: ' "$env_log" | tail -n 1 | cut -d' ' -f2-)
  gpus=$(grep '^gpu_count: ' "$env_log" | tail -n 1 | cut -d' ' -f2)
fi
case $gpus in ''|*[!0-9]*) gpus=0 ;; esac
# Triton builds a small C launcher for every kernel it compiles: without a C compiler torch.compile's
# default backend fails on the GPU (compile_syncbn then falls back to aot_eager and says so)
compiler=$(command -v "${CC:-cc}" || command -v gcc || command -v clang || echo none)
{
  echo "--- C compiler: $compiler"
  if [ "$compiler" != none ]; then timeout 10 "$compiler" --version 2>&1 | head -n 1; fi
  echo "--- pip list"
} >> "$env_log"
timeout 60 "$py" -m pip list >> "$env_log" 2>&1 || echo "(pip list failed)" >> "$env_log"
torch_summary="${torch_summary:-torch imports}; C compiler: $compiler"
if [ "$rc" -ne 0 ]; then
  verdict environment "torch does not import with $py (environment.txt)"
elif [ $dry_run = 0 ] && [ "$gpus" -lt 1 ]; then
  record FAIL $((SECONDS - env_start)) environment "$torch_summary; no CUDA device visible (on a CPU machine, use --dry-run)"
else
  record PASS $((SECONDS - env_start)) environment "$torch_summary"
fi

# ---------------------------------------------------------------------------------------------- deps
# What train.py needs at run time (requirements.txt; import names), checked in one process.
runtime_modules=(albumentations cv2 numpy PIL yaml scipy tensorboard tqdm)
check_imports() {  # prints "name (error); ..." for the modules that do not import, nothing when all do
  timeout 120 "$py" - "${runtime_modules[@]}" 2>> "$env_log" <<'EOF_PY'
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - any failure to import counts
        missing.append(f"{name} ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
print("; ".join(missing))
EOF_PY
}
echo "--- deps: import ${runtime_modules[*]}" >> "$env_log"
deps_start=$SECONDS
missing=$(check_imports)
if [ $? -ne 0 ]; then missing="the import check itself failed (environment.txt)"; fi
deps_ok=0
if [ -z "$missing" ]; then
  deps_ok=1
  record PASS $((SECONDS - deps_start)) deps "the runtime requirements import; nothing installed"
else
  echo "missing: $missing" >> "$env_log"
  shopt -s nullglob
  wheel_files=("$wheels"/*.whl)
  shopt -u nullglob
  if [ ${#wheel_files[@]} -eq 0 ]; then
    record FAIL $((SECONDS - deps_start)) deps "missing: $missing; no wheels in $wheels (run python scripts/gpu_wheels.py where PyPI is reachable and bring that folder: carry=['.gpu_wheels'])"
  else
    # pip with the command line's settings alone: the image's pip.conf or PIP_* variables (a constraint,
    # --user, an index) must not change an offline install into a private folder
    pip_env=(env)
    for name in $(compgen -e | grep '^PIP_'); do pip_env+=(-u "$name"); done
    pip_env+=(PIP_CONFIG_FILE=/dev/null PIP_ROOT_USER_ACTION=ignore)
    bounded 120 "$env_log" "${pip_env[@]}" "$py" -m pip install --no-index --no-deps --no-compile \
      --disable-pip-version-check --target "$work/site" "${wheel_files[@]}"
    if [ "$rc" -ne 0 ]; then
      verdict deps "pip could not install the ${#wheel_files[@]} wheels of $wheels (environment.txt); missing: $missing"
    else
      export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
      echo "--- deps: PYTHONPATH=$PYTHONPATH; import again" >> "$env_log"
      still=$(check_imports)
      if [ -z "$still" ]; then
        deps_ok=1
        record PASS $((SECONDS - deps_start)) deps "installed ${#wheel_files[@]} wheels from $wheels into a private folder on PYTHONPATH; the runtime requirements import"
      else
        echo "still missing: $still" >> "$env_log"
        record FAIL $((SECONDS - deps_start)) deps "still missing after installing ${#wheel_files[@]} wheels from $wheels: $still"
      fi
    fi
  fi
fi
echo "--- deps: what imports, from where" >> "$env_log"
timeout 60 "$py" -c 'import importlib, sys
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "(no __version__)"), module.__file__)
    except Exception as error:  # noqa: BLE001
        print(name, "does not import:", type(error).__name__, error)' \
  albumentations albucore pydantic pydantic_core typing_extensions numpy cv2 torch torchvision >> "$env_log" 2>&1

# ---------------------------------------------------------------------------------------------- training
# Short trainings of the demo on GPU 0, one per precision path: the run folders (checkpoints of ~155 MB) stay in
# the work folder; only their metrics come back. The dry run trains 1-2 iterations of a tiny demo on the CPU
# in fp32 (fp16 on a CPU took a minute and a half for 2 iterations).
if [ $dry_run = 1 ]; then
  device_args=()
  size_args=(train.batch_size=2 data.num_workers=0 data.synthetic_train_size=4 data.synthetic_val_size=2
             data.synthetic_image_size=64 data.crop_size=64 train.log_interval=1 eval.amp=off train.num_vis_images=0)
  fp16_first=(train.amp=off train.iters=1 train.ckpt_interval=1 train.val_interval=1000)
  fp16_resume=(train.amp=off train.iters=2 train.ckpt_interval=1 train.val_interval=2)
else
  device_args=(--gpus 0)
  size_args=(data.num_workers=4 data.synthetic_train_size=400 data.synthetic_val_size=32 train.log_interval=5)
  fp16_first=(train.amp=fp16 train.iters=10 train.ckpt_interval=10 train.val_interval=1000)
  fp16_resume=(train.amp=fp16 train.iters=20 train.ckpt_interval=10 train.val_interval=20)
fi
demo=(train.py --config demo.yaml "${device_args[@]}")

# section LOG: the lines a `bounded` run appended to LOG (its header and footer lines left out).
section_start=0
mark() { section_start=$(wc -l < "$1"); }
section() { tail -n +"$((section_start + 1))" "$1" | grep -v '^=== '; }

# not_run NAME REASON: a training that cannot run here, said in all three places.
not_run() {
  echo "--- $1: not run ($2)" >> "$train_log"
  record SKIPPED 0 "$1" "$2"
  add_metrics "$1" "$work/runs/$1" "$2" > /dev/null 2>> "$train_log"
}
# probe STEP LOG DRY_REASON BUDGET ARGS...: `python -m scripts.gpu_probes ARGS`; its last RESULT line is the detail,
# its exit status 3 (cannot run here) a SKIPPED line.
probe() {
  local step=$1 log=$2 dry_reason=$3 budget=$4 detail
  shift 4
  if ! selected "$step"; then unselected "$step"; return; fi
  echo "--- $step" >> "$log"
  mark "$log"
  bounded "$budget" "$log" "$py" -m scripts.gpu_probes "$@"
  detail=$(section "$log" | grep '^RESULT: ' | tail -n 1 | cut -c9-)
  if [ "$rc" -eq 3 ]; then
    record SKIPPED "$took" "$step" "${detail:-cannot run here}"
  else
    verdict "$step" "$detail" "$dry_reason${detail:+ ($detail)}"
  fi
}

deps_reason="the runtime requirements do not import (deps)"
if [ $deps_ok = 0 ]; then
  for name in train_fp16_resume train_bf16_channels_last train_off_sigterm train_ddp2; do not_run "$name" "$deps_reason"; done
else
  # fp16 + GradScaler + fused AdamW, resumed from the checkpoint an unfused optimizer would have written: torch
  # moves a loaded step to the parameter's device only when the saved group was fused (issue 30)
  name=train_fp16_resume run=$work/runs/train_fp16_resume step_start=$SECONDS
  if ! selected $name; then not_run $name "$unselected_reason"; else
  echo "--- $name: first part" >> "$train_log"
  bounded 80 "$train_log" "$py" "${demo[@]}" output_dir="$run" "${size_args[@]}" "${fp16_first[@]}"
  detail="first part"
  if [ "$rc" -eq 0 ]; then
    echo "--- $name: last.pt as the unfused optimizer saved it" >> "$train_log"
    mark "$train_log"
    bounded 40 "$train_log" "$py" -m scripts.gpu_probes unfuse "$run/last.pt"
    detail="unfuse"
    if [ "$rc" -eq 0 ]; then
      unfused=$(section "$train_log" | grep '^RESULT: ' | tail -n 1 | cut -c9-)
      echo "--- $name: the resume" >> "$train_log"
      bounded 80 "$train_log" "$py" "${demo[@]}" --resume auto output_dir="$run" "${size_args[@]}" "${fp16_resume[@]}"
      detail="resume; $unfused"
      [ "$rc" -eq 0 ] && detail="10 iterations fp16 + GradScaler + fused AdamW, resumed to 20 from last.pt made unfused"
    fi
  fi
  took=$((SECONDS - step_start))
  val=$(add_metrics "$name" "$run" 2>> "$train_log")
  verdict "$name" "$detail${val:+; $val}" "no CUDA device; 1 fp32 CPU iteration, its last.pt made unfused, resumed to 2"
  fi

  if ! selected train_bf16_channels_last; then
    not_run train_bf16_channels_last "$unselected_reason"
  elif [ $dry_run = 1 ]; then  # the overrides checked, nothing trained
    echo "--- train_bf16_channels_last: the config it would train with" >> "$train_log"
    bounded 60 "$train_log" "$py" "${demo[@]}" --print-config output_dir="$work/runs/train_bf16_channels_last" \
      train.amp=auto model.channels_last=auto train.iters=20
    verdict train_bf16_channels_last "" "no CUDA device; train.py --print-config checked its overrides"
    add_metrics train_bf16_channels_last "$work/runs/train_bf16_channels_last" "dry run: its config checked, nothing trained" \
      > /dev/null 2>> "$train_log"
  else
    echo "--- train_bf16_channels_last" >> "$train_log"
    mark "$train_log"
    bounded 80 "$train_log" "$py" "${demo[@]}" output_dir="$work/runs/train_bf16_channels_last" "${size_args[@]}" \
      train.amp=auto model.channels_last=auto train.iters=20 train.val_interval=20 train.ckpt_interval=20
    # what ran, as the log says it: "train.amp=auto: bf16 (...)" and "model.channels_last=auto: on"
    layout=$(section "$train_log" | grep -oE '(train\.amp=auto: [a-z0-9]+|model\.channels_last=auto: [a-z]+)' | paste -sd ',' -)
    val=$(add_metrics train_bf16_channels_last "$work/runs/train_bf16_channels_last" 2>> "$train_log")
    verdict train_bf16_channels_last "20 iterations; ${layout:-no precision line}${val:+; $val}"
  fi

  # full fp32 (TF32 off) stopped by SIGTERM mid-step: exit 143, last.pt saved, the stop line
  if ! selected train_off_sigterm; then not_run train_off_sigterm "$unselected_reason"; else
  probe train_off_sigterm "$train_log" "no CUDA device; the same on the CPU" 80 sigterm -- "${demo[@]:1}" \
    output_dir="$work/runs/train_off_sigterm" "${size_args[@]}" train.amp=off train.iters=2000 train.log_interval=1 \
    train.val_interval=5000 train.ckpt_interval=5000
  add_metrics train_off_sigterm "$work/runs/train_off_sigterm" > /dev/null 2>> "$train_log"
  fi

  if ! selected train_ddp2; then
    not_run train_ddp2 "$unselected_reason"
  elif [ $dry_run = 1 ]; then
    not_run train_ddp2 "dry run: needs 2 GPUs; $gpus here"
  elif [ "$gpus" -lt 2 ]; then
    not_run train_ddp2 "needs 2 GPUs; $gpus here"
  else
    echo "--- train_ddp2" >> "$train_log"
    bounded 90 "$train_log" env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "$py" -m torch.distributed.run --standalone \
      --nproc_per_node 2 train.py --config demo.yaml output_dir="$work/runs/train_ddp2" "${size_args[@]}" \
      train.iters=20 train.val_interval=20 train.ckpt_interval=20
    val=$(add_metrics train_ddp2 "$work/runs/train_ddp2" 2>> "$train_log")
    verdict train_ddp2 "2 processes, 20 iterations, amp auto${val:+; $val}"
  fi
fi

# ---------------------------------------------------------------------------------------------- probes
probe_device=cuda
[ $dry_run = 1 ] && probe_device=cpu
probe tf32 "$probes_log" "no CUDA device; measured on the CPU" 40 tf32 --device $probe_device
if [ $deps_ok = 0 ]; then
  record SKIPPED 0 bad_mask "$deps_reason"
else
  probe bad_mask "$train_log" "no CUDA device; the same on the CPU" 60 bad-mask --device $probe_device -- \
    "${demo[@]:1}" output_dir="$work/runs/bad_mask" "${size_args[@]}" train.iters=5
fi
probe two_processes_one_gpu "$probes_log" "no CUDA device; two CPU processes" 90 two-processes --device $probe_device
probe dp_one_gpu "$probes_log" "no CUDA device" 45 dp-one-gpu --device $probe_device
if [ $dry_run = 1 ]; then
  probe compile_syncbn "$probes_log" "no CUDA device; two CPU processes with aot_eager" 150 compile --device cpu --backend aot_eager
else
  probe compile_syncbn "$probes_log" "" 150 compile --device cuda
fi
if [ $deps_ok = 0 ]; then
  record SKIPPED 0 val_autotune "$deps_reason"
elif [ $dry_run = 1 ]; then
  probe val_autotune "$probes_log" "no CUDA device; 2 CPU images a way" 60 val-autotune --device cpu --images 2
else
  probe val_autotune "$probes_log" "" 60 val-autotune --device cuda --images 12
fi

# ---------------------------------------------------------------------------------------------- cuda_tests
# One pytest run per file that declares CUDA tests (marker `cuda`): a collection error (a missing
# requirement) or a crash costs that file alone. The files share one time budget.
TESTS_BUDGET=120
tests_deadline=$((SECONDS + TESTS_BUDGET))
mapfile -t cuda_tests < <(grep -rl "mark.cuda" tests --include='test_*.py' | sort)
echo "CUDA test files: ${cuda_tests[*]}" >> "$tests_log"
if [ ${#cuda_tests[@]} -eq 0 ]; then record FAIL 0 cuda_tests "no test file declares mark.cuda under tests/"; fi
for file in "${cuda_tests[@]}"; do
  if ! selected cuda_tests; then unselected "cuda_tests:${file#tests/}"; continue; fi
  left=$((tests_deadline - SECONDS))
  if [ "$left" -gt 100 ]; then left=100; fi
  start_line=$(wc -l < "$tests_log")
  bounded "$left" "$tests_log" "$py" -m pytest -q -m cuda -p no:cacheprovider -o addopts= -o timeout=90 -rA "$file"
  section=$(tail -n +"$((start_line + 1))" "$tests_log" | grep -v '^=== ')
  # pytest's closing line; else (pytest did not get that far) the last error line, else the last line
  outcome=$(echo "$section" | grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)|no tests ran' | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  outcome=${outcome:-$(echo "$section" | grep -E '^E ' | tail -n 1 | sed -E 's/^E +//')}
  outcome=${outcome:-$(echo "$section" | grep -v '^[[:space:]]*$' | tail -n 1)}
  step="cuda_tests:${file#tests/}"
  if [ "$rc" -eq 0 ] && ! echo "$outcome" | grep -q passed; then
    record SKIPPED "$took" "$step" "${outcome:-no outcome line}$([ $dry_run = 1 ] && echo ' (dry run: no CUDA device)'); the reasons are in cuda_tests.txt"
  elif [ "$rc" -eq 5 ]; then
    record SKIPPED "$took" "$step" "no test marked cuda was collected"
  elif [ "$rc" -eq -1 ]; then
    record SKIPPED 0 "$step" "not run: the time is spent (CUDA tests ${TESTS_BUDGET} s, all steps ${TOTAL_BUDGET} s)"
  else
    verdict "$step" "$outcome"
  fi
done

# ---------------------------------------------------------------------------------------------- benchmarks
# SyncBN against torch.nn.SyncBatchNorm / nn.BatchNorm2d on three shapes (one process; two with NCCL when
# there are 2 GPUs), then training images/s and peak memory, fp32 vs fp16 autocast + channels_last. The
# layer part's JSON is written before the training part imports the engine.
if ! selected bench_cuda; then
  unselected bench_cuda
  rc=-3 took=0  # note_json: "not selected"
elif [ $dry_run = 1 ]; then
  bounded 150 "$bench_log" "$py" -m benchmarks.bench_cuda --device cpu --repeats 2 --train-iters 1 --output "$cuda_json"
  verdict bench_cuda "" "no CUDA device; tiny CPU shapes checked the layer part, and the engine imports"
else
  bounded 150 "$bench_log" "$py" -m benchmarks.bench_cuda --repeats 30 --train-iters 20 --train-rounds 2 --output "$cuda_json"
  verdict bench_cuda "bench_cuda.json"
fi
note_json "$cuda_json"

if ! selected bench_syncbn; then
  unselected bench_syncbn
elif [ $dry_run = 1 ]; then
  bounded 60 "$bench_log" "$py" -m benchmarks.bench_syncbn --help
  verdict bench_syncbn "" "no CUDA device; its --help checked that it imports"
else
  bounded 60 "$bench_log" "$py" -m benchmarks.bench_syncbn --device cuda --skip-distributed --repeats 30 --output "$syncbn_json"
  verdict bench_syncbn "its table in benchmarks.txt"
fi

echo "finished with status $status in ${SECONDS} s: $counts_pass passed, $counts_fail failed or timed out, $counts_skip skipped$([ $dry_run = 1 ] && echo ' (dry run)')" >> "$summary"
echo
cat "$summary"
echo "results in $out"
exit $status
