#!/usr/bin/env bash
# GPU checks for a borrowed one-GPU machine whose image ships its own torch (docs/maintainers.md "GPU check"): one
# run of at most 10 minutes. The measurements first (the DeepLabV3+ / ResNet-101 training step's speed, memory and
# MFU; the same step with our SyncBN, torch.nn.SyncBatchNorm and BatchNorm2d; its host syncs), then the correctness
# steps (the fused input gradient, the layers compiled, DataParallel and two processes on the one GPU, every
# precision path in short trainings, a bad mask value, TF32, every CUDA test). Each step has a reserved slice of
# time (PLAN below, at most 9 minutes in all, checked) that is its timeout; a probe gets an inner deadline a
# few seconds shorter and prints its partial records as it goes, and every log is capped so that the files come
# back (the 8 named in the usage). Written for the image as it is: the runtime requirements it lacks
# (albumentations and its closure) are installed offline from the wheels that scripts/gpu_wheels.py downloaded
# beforehand; each step runs in a process of its own under `timeout`, so an import error, a crash or a hang costs
# that step alone. The Python steps are scripts/gpu_probes.py's subcommands.
set -uo pipefail

# STEP SECONDS, in the order they run: each step's timeout is its slice (sub-commands of a step share it).
PLAN="environment 15
deps 30
step 60
step_norms 65
host_syncs 30
fused_grad 20
compile_syncbn 55
dp_one_gpu 20
two_processes_one_gpu 40
train_bf16_channels_last 40
train_fp16_resume 50
train_off_sigterm 30
bad_mask 20
tf32 15
cuda_tests 40"
RESERVED_LIMIT=540  # 9 minutes of slices; the bookkeeping between steps fits in the rest of the 10
ALL_STEPS=$(echo "$PLAN" | cut -d' ' -f1 | paste -sd' ' -)
RESERVED=0
for seconds in $(echo "$PLAN" | cut -d' ' -f2); do RESERVED=$((RESERVED + seconds)); done
if [ "$RESERVED" -gt "$RESERVED_LIMIT" ]; then
  echo "gpu_check.sh: its PLAN reserves ${RESERVED} s, more than ${RESERVED_LIMIT} s: shorten a slice" >&2
  exit 2
fi

usage() {
  cat <<EOF_USAGE
usage: scripts/gpu_check.sh OUTPUT_DIR [--dry-run] [--wheels DIR] [--steps STEP,STEP...]

Runs these steps in this order, each under its timeout (its reserved seconds; ${RESERVED} s in all, within
GPU_CHECK_SECONDS), a step that fails or times out recorded and the next one run, the steps the time does
not reach recorded as not run:
$(echo "$PLAN" | awk '{printf "  %-26s %3d s\n", $1, $2}')
What each step does:
  environment   date, nvidia-smi, Python, torch and its CUDA, the C compiler Triton would use, pip list
  deps          imports the runtime requirements; when one fails, installs the wheels in DIR offline
                (pip --no-index --no-deps --target) into a private temporary folder put on PYTHONPATH
  step          one DeepLabV3+ / ResNet-101 training step (Trainer.train_step, voc.yaml's model, loss and SGD) in
                bf16 and channels-last at 8x512x512: images/s, peak memory, FLOPs (torch.utils.flop_counter)
                and MFU against the GPU's dense bf16 peak (data sheet) and against a bf16 matmul measured there
  step_norms    that step in two processes on GPU 0 (4 images each, no DDP) with our SyncBN, torch.nn.SyncBatchNorm,
                BatchNorm2d and a BatchNorm2d copy (A/A), interleaved; over NCCL if it accepts two ranks on one
                GPU, else over gloo on CUDA tensors (said); target ours / torch's <= 1.2
  host_syncs    one training step of the demo's model at 256 px under torch.cuda.set_sync_debug_mode("warn"), on
                the one-process and the synchronized path (a 1-process NCCL group), bf16: 0 warnings expected
                (fp16's GradScaler reported, not judged)
  fused_grad    the synchronized layer's output and fused input gradient against nn.BatchNorm2d, both against
                float64: fp32 and bf16, NCHW and NHWC
  compile_syncbn
                the synchronized layers compiled (inductor, else aot_eager) in two processes on GPU 0, and
                whether a C compiler and Triton are there
  dp_one_gpu    DataParallelWithCallback with two replicas on GPU 0, fp32 and bf16 autocast, or why torch
                does not build them
  two_processes_one_gpu
                DDP with synchronized BN in two processes on GPU 0 over gloo (NCCL refuses two ranks on one
                GPU; its answer is recorded) against nn.BatchNorm2d, then a killed peer: the survivor's
                lost-contact line
  train_bf16_channels_last
                20 iterations of the demo with train.amp=auto and model.channels_last=auto (bf16 in
                channels-last on an Ampere or newer GPU); the log's precision and layout lines
  train_fp16_resume
                10 iterations of the demo on GPU 0 in fp16 with a GradScaler and the fused AdamW, its last.pt
                rewritten as the unfused optimizer saved it (gpu_probes unfuse), resumed to 20
  train_off_sigterm
                train.amp=off (full fp32, TF32 off) stopped by SIGTERM after its first logged step: expects
                exit 143 and the stop line (gpu_probes sigterm)
  bad_mask      a mask value outside the classes: expects exit 2 and the one-line error, not a device-side
                assert (gpu_probes bad-mask)
  tf32          fp32 convolution and matmul, amp off against amp tf32: error against float64 and time
  cuda_tests    every test file that declares CUDA tests, one pytest run per file (-m cuda), sharing the slice
Writes exactly these files in OUTPUT_DIR (created if needed; a relative path is taken from where the
script was started), each as soon as its step ends, every log capped at ${LOG_CAP_KIB:-512} KiB a command (head
and tail kept, the cut marked):
  summary.txt          the plan, then one line a step: STATUS SECONDS STEP DETAIL (PASS, FAIL, TIMEOUT, SKIPPED)
  environment.txt      the environment and the deps step's log
  measurements.txt     the output of step, step_norms, host_syncs
  measurements.json    each probe's last RECORD (what it measured, partial when it was cut short) and outcome
  probes.txt           the output of fused_grad, compile_syncbn, dp_one_gpu, two_processes_one_gpu, tf32
  train.txt            the training logs (train_*, bad_mask)
  train_metrics.json   each training's status and its metrics.jsonl records (run folders and
                       checkpoints stay in a temporary folder, deleted at the end)
  cuda_tests.txt       the pytest output of every CUDA test file
Options:
  --steps LIST   run only these steps (comma-separated names from the list above; \`cuda_tests\` stands for
                 every CUDA test file); environment and deps always run, the others are recorded as
                 SKIPPED "not selected". To rerun what failed after a fix without spending the device
                 time on the rest, e.g. --steps train_fp16_resume,compile_syncbn
  --wheels DIR   wheels for the deps step (default: .gpu_wheels in the repository root, made by
                 \`python scripts/gpu_wheels.py\` where PyPI is reachable; the device tool copies it
                 only when the call names it: carry=['.gpu_wheels'])
  --dry-run      for a CPU machine: prints the same plan and runs the same steps' plumbing on the CPU, each
                 slice stretched GPU_CHECK_DRY_SCALE times (default 3: two cores, no GPU): every probe on
                 tiny CPU shapes (host_syncs counts on fake CUDA tensors instead), the fp16 resume as a
                 1-iteration CPU run in fp32, its unfuse and its resume, the SIGTERM and bad-mask runs,
                 each CUDA test file, whose tests skip themselves; each GPU step is recorded as SKIPPED
                 with why, in the same files. To rehearse the GPU image here (its missing packages hidden,
                 installed from wheels for this machine's Python, e.g. 3.11):
                   python scripts/gpu_wheels.py --python-version 3.11 /tmp/wheels311
                   PYTHONPATH=\$PWD/scripts/gpu_image scripts/gpu_check.sh --dry-run --wheels /tmp/wheels311 OUT
Python: \$PYTHON, else .venv/bin/python when it exists, else python3 (the GPU image's own).
GPU_CHECK_SECONDS: the time for all steps and the bookkeeping between them (default 570, the dry run's
stretched likewise); a step never runs past it.
Exit status: 0 when no step failed or timed out, 1 otherwise, 2 on a usage error.
EOF_USAGE
}

dry_run=0
wheels=""
out=""
steps=""
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
    case " $ALL_STEPS " in
      *" $step "*) ;;
      *) echo "gpu_check.sh: --steps: unknown step '$step'; the steps: ${ALL_STEPS// /,}" >&2; exit 2 ;;
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

scale=1
if [ $dry_run = 1 ]; then scale=${GPU_CHECK_DRY_SCALE:-3}; fi
case $scale in ''|*[!0-9]*|0) echo "gpu_check.sh: GPU_CHECK_DRY_SCALE must be a whole number >= 1, got '$scale'" >&2; exit 2 ;; esac
TOTAL_BUDGET=${GPU_CHECK_SECONDS:-$((570 * scale))}
LOG_CAP=$(( ${LOG_CAP_KIB:-512} * 1024 ))
deadline=$((SECONDS + TOTAL_BUDGET))
status=0
counts_pass=0 counts_fail=0 counts_skip=0

summary=$out/summary.txt
env_log=$out/environment.txt
measure_log=$out/measurements.txt
measure_json=$out/measurements.json
probes_log=$out/probes.txt
train_log=$out/train.txt
metrics_json=$out/train_metrics.json
tests_log=$out/cuda_tests.txt
# Every file exists from the start, so a step that dies leaves the same file set behind.
for file in "$env_log" "$measure_log" "$probes_log" "$train_log" "$tests_log"; do : > "$file"; done
echo '{}' > "$metrics_json"
echo '{}' > "$measure_json"
{
  echo "gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC')$([ $dry_run = 1 ] && echo ', DRY RUN (no GPU steps)'); python: $py; wheels: $wheels$([ -n "$steps" ] && echo "; steps: $steps")"
  echo "plan: $(echo "$PLAN" | awk '{printf "%s%s %d s", (NR > 1 ? ", " : ""), $1, $2}'); reserved ${RESERVED} s of at most ${RESERVED_LIMIT} s, all within ${TOTAL_BUDGET} s$([ "$scale" != 1 ] && echo "; dry run: each slice x${scale}")"
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

# begin STEP: the step's own deadline, its slice from PLAN (times the dry run's scale) from now, never past the
# deadline of all steps. Sets step_name, step_start, step_end.
begin() {
  local slice
  slice=$(echo "$PLAN" | awk -v step="$1" '$1 == step {print $2}')
  step_name=$1 step_start=$SECONDS step_end=$((SECONDS + ${slice:-0} * scale))
  if [ "$step_end" -gt "$deadline" ]; then step_end=$deadline; fi
}

# capped LOG FILE: FILE appended to LOG, at most LOG_CAP bytes of it (its head and tail, the cut marked).
capped() {
  local size
  size=$(wc -c < "$2")
  if [ "$size" -le "$LOG_CAP" ]; then cat "$2" >> "$1"; return; fi
  { head -c $((LOG_CAP / 2)) "$2"
    printf '\n[... gpu_check: %d bytes cut here, to keep this file small enough to come back ...]\n' $((size - LOG_CAP))
    tail -c $((LOG_CAP / 2)) "$2"; } >> "$1"
}

# bounded LOG COMMAND...: runs COMMAND with its output (capped) appended to LOG, under `timeout`, until the
# current step's end. Sets rc (124: timed out, -1: not run, no time left), took (seconds) and limit (the timeout).
bounded() {
  local log=$1
  shift
  limit=$((step_end - SECONDS))
  took=0
  if [ "$limit" -lt 10 ]; then
    rc=-1
    echo "=== not run, no time left (step ${step_name}, all steps ${TOTAL_BUDGET} s): $*" >> "$log"
    return
  fi
  echo "=== $* (timeout ${limit} s)" >> "$log"
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" > "$work/command.log" 2>&1 < /dev/null
  rc=$?
  took=$((SECONDS - start))
  if [ "$rc" -eq 137 ]; then rc=124; fi
  capped "$log" "$work/command.log"
  echo "=== exit status $rc after ${took} s" >> "$log"
}

# selected STEP: whether --steps leaves STEP to run (all do without --steps). unselected STEP: its summary line.
unselected_reason="not selected (--steps $steps)"
selected() { [ -z "$steps" ] || case ",$steps," in *",$1,"*) true ;; *) false ;; esac; }
unselected() { record SKIPPED 0 "$1" "$unselected_reason"; }

# verdict STEP DETAIL [DRY_REASON]: the summary line for the last `bounded` run, its seconds those of the whole
# step. In a dry run a command that succeeded stands in for the GPU step, which is SKIPPED with DRY_REASON.
verdict() {
  local step=$1 detail=$2 dry_reason=${3:-} seconds=$((SECONDS - step_start))
  case $rc in
    0) if [ $dry_run = 1 ] && [ -n "$dry_reason" ]; then record SKIPPED "$seconds" "$step" "dry run: $dry_reason"
       else record PASS "$seconds" "$step" "$detail"; fi ;;
    124) record TIMEOUT "$seconds" "$step" "stopped after ${limit} s${detail:+; $detail}" ;;
    -1) record SKIPPED 0 "$step" "not run: no time left of the ${TOTAL_BUDGET} s for all steps" ;;
    *) record FAIL "$seconds" "$step" "exit status $rc${detail:+; $detail}" ;;
  esac
}

# add_record STEP LOG: the last RECORD line the step's probe printed (its partial record when it was cut short)
# into measurements.json under STEP, with how the step ended.
add_record() {
  local line
  line=$(section "$2" | grep '^RECORD: ' | tail -n 1 | cut -c9-)
  "$py" - "$measure_json" "$1" "$rc" "$took" "$dry_run" "$line" <<'EOF_PY' 2>> "$2"
import json, sys
from pathlib import Path
path, step, rc, took, dry_run, line = sys.argv[1:]
data = json.loads(Path(path).read_text())
outcome = {"0": "done", "3": "cannot run here", "124": "timed out", "-1": "not run: no time left"}.get(rc, f"failed ({rc})")
entry = {"outcome": outcome, "exit_status": int(rc), "seconds": int(took), "dry_run": dry_run == "1"}
try:
    entry["record"] = json.loads(line) if line else None
except ValueError:
    entry["record"] = {"unreadable": line[:500]}
data[step] = entry
Path(path).write_text(json.dumps(data, indent=2))
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
    outcome = {"0": "done", "124": "timed out", "-1": "not run: no time left"}.get(rc, f"failed ({rc})")
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

# section LOG: the lines a `bounded` run appended to LOG since `mark LOG` (its header and footer lines left out).
section_start=0
mark() { section_start=$(wc -l < "$1"); }
section() { tail -n +"$((section_start + 1))" "$1" | grep -v '^=== '; }

# ---------------------------------------------------------------------------------------------- environment
begin environment
gpus=0 torch_summary=""
{
  echo "host: $(uname -a)"
  echo "started in: $root; OUTPUT_DIR: $out; work folder: $work"
  echo "--- nvidia-smi"
} >> "$env_log"
if command -v nvidia-smi > /dev/null; then timeout 10 nvidia-smi >> "$env_log" 2>&1; else echo "nvidia-smi: not found" >> "$env_log"; fi
echo "--- python and torch" >> "$env_log"
bounded "$env_log" "$py" -c 'import platform, sys, torch
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
timeout 20 "$py" -m pip list >> "$env_log" 2>&1 || echo "(pip list failed)" >> "$env_log"
torch_summary="${torch_summary:-torch imports}; C compiler: $compiler"
if [ "$rc" -ne 0 ]; then
  verdict environment "torch does not import with $py (environment.txt)"
elif [ $dry_run = 0 ] && [ "$gpus" -lt 1 ]; then
  record FAIL $((SECONDS - step_start)) environment "$torch_summary; no CUDA device visible (on a CPU machine, use --dry-run)"
else
  record PASS $((SECONDS - step_start)) environment "$torch_summary"
fi

# ---------------------------------------------------------------------------------------------- deps
# What train.py needs at run time (requirements.txt; import names), checked in one process.
runtime_modules=(albumentations cv2 numpy PIL yaml scipy tensorboard tqdm)
check_imports() {  # prints "name (error); ..." for the modules that do not import, nothing when all do
  timeout 60 "$py" - "${runtime_modules[@]}" 2>> "$env_log" <<'EOF_PY'
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
begin deps
missing=$(check_imports)
if [ $? -ne 0 ]; then missing="the import check itself failed (environment.txt)"; fi
deps_ok=0
if [ -z "$missing" ]; then
  deps_ok=1
  record PASS $((SECONDS - step_start)) deps "the runtime requirements import; nothing installed"
else
  echo "missing: $missing" >> "$env_log"
  shopt -s nullglob
  wheel_files=("$wheels"/*.whl)
  shopt -u nullglob
  if [ ${#wheel_files[@]} -eq 0 ]; then
    record FAIL $((SECONDS - step_start)) deps "missing: $missing; no wheels in $wheels (run python scripts/gpu_wheels.py where PyPI is reachable and bring that folder: carry=['.gpu_wheels'])"
  else
    # pip with the command line's settings alone: the image's pip.conf or PIP_* variables (a constraint,
    # --user, an index) must not change an offline install into a private folder
    pip_env=(env)
    for name in $(compgen -e | grep '^PIP_'); do pip_env+=(-u "$name"); done
    pip_env+=(PIP_CONFIG_FILE=/dev/null PIP_ROOT_USER_ACTION=ignore)
    bounded "$env_log" "${pip_env[@]}" "$py" -m pip install --no-index --no-deps --no-compile \
      --disable-pip-version-check --target "$work/site" "${wheel_files[@]}"
    if [ "$rc" -ne 0 ]; then
      verdict deps "pip could not install the ${#wheel_files[@]} wheels of $wheels (environment.txt); missing: $missing"
    else
      export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
      echo "--- deps: PYTHONPATH=$PYTHONPATH; import again" >> "$env_log"
      still=$(check_imports)
      if [ -z "$still" ]; then
        deps_ok=1
        record PASS $((SECONDS - step_start)) deps "installed ${#wheel_files[@]} wheels from $wheels into a private folder on PYTHONPATH; the runtime requirements import"
      else
        echo "still missing: $still" >> "$env_log"
        record FAIL $((SECONDS - step_start)) deps "still missing after installing ${#wheel_files[@]} wheels from $wheels: $still"
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


# ---------------------------------------------------------------------------------------------- probes
# probe STEP LOG DRY_REASON ARGS...: `python -m scripts.gpu_probes ARGS --deadline D`, D a few seconds inside the
# step's slice; its last RESULT line is the detail, its exit status 3 (cannot run here) a SKIPPED line, its last
# RECORD line (null if none) and outcome its entry in measurements.json.
probe_device=cuda
[ $dry_run = 1 ] && probe_device=cpu
deps_reason="the runtime requirements do not import (deps)"
probe() {
  local step=$1 log=$2 dry_reason=$3 detail inner
  shift 3
  if ! selected "$step"; then unselected "$step"; return; fi
  begin "$step"
  inner=$((step_end - SECONDS - 5))
  if [ "$inner" -lt 5 ]; then inner=5; fi
  echo "--- $step" >> "$log"
  mark "$log"
  bounded "$log" "$py" -m scripts.gpu_probes --deadline "$inner" "$@"
  detail=$(section "$log" | grep '^RESULT: ' | tail -n 1 | cut -c9-)
  add_record "$step" "$log"
  if [ "$rc" -eq 3 ]; then
    record SKIPPED "$((SECONDS - step_start))" "$step" "${detail:-cannot run here}"
  else
    verdict "$step" "$detail" "$dry_reason${detail:+ ($detail)}"
  fi
}
# needs_deps STEP: false, with the step's SKIPPED line, when the runtime requirements do not import.
needs_deps() {
  if [ $deps_ok = 1 ] || ! selected "$1"; then return 0; fi
  record SKIPPED 0 "$1" "$deps_reason"
  return 1
}

# The measurements: the step's speed, memory and MFU; the same with each norm in two processes; its host syncs.
needs_deps step && probe step "$measure_log" "no CUDA device; a tiny fp32 step on the CPU" step --device $probe_device
needs_deps step_norms && probe step_norms "$measure_log" "no CUDA device; two CPU processes over gloo, tiny shapes" \
  step-norms --device $probe_device
needs_deps host_syncs && probe host_syncs "$measure_log" "no CUDA device; counted on fake CUDA tensors" \
  host-syncs --device $probe_device
# The correctness steps.
probe fused_grad "$probes_log" "no CUDA device; the same on the CPU (no fused kernels there)" fused-grad --device $probe_device
if [ $dry_run = 1 ]; then
  probe compile_syncbn "$probes_log" "no CUDA device; two CPU processes with aot_eager" compile --device cpu --backend aot_eager
else
  probe compile_syncbn "$probes_log" "" compile --device cuda
fi
probe dp_one_gpu "$probes_log" "no CUDA device" dp-one-gpu --device $probe_device
probe two_processes_one_gpu "$probes_log" "no CUDA device; two CPU processes" two-processes --device $probe_device

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

# not_run NAME REASON: a training that cannot run here, said in all three places.
not_run() {
  echo "--- $1: not run ($2)" >> "$train_log"
  record SKIPPED 0 "$1" "$2"
  add_metrics "$1" "$work/runs/$1" "$2" > /dev/null 2>> "$train_log"
}

if [ $deps_ok = 0 ]; then
  for name in train_bf16_channels_last train_fp16_resume train_off_sigterm; do not_run "$name" "$deps_reason"; done
else
  if ! selected train_bf16_channels_last; then
    not_run train_bf16_channels_last "$unselected_reason"
  elif [ $dry_run = 1 ]; then  # the overrides checked, nothing trained
    begin train_bf16_channels_last
    echo "--- train_bf16_channels_last: the config it would train with" >> "$train_log"
    bounded "$train_log" "$py" "${demo[@]}" --print-config output_dir="$work/runs/train_bf16_channels_last" \
      train.amp=auto model.channels_last=auto train.iters=20
    verdict train_bf16_channels_last "" "no CUDA device; train.py --print-config checked its overrides"
    add_metrics train_bf16_channels_last "$work/runs/train_bf16_channels_last" "dry run: its config checked, nothing trained" \
      > /dev/null 2>> "$train_log"
  else
    begin train_bf16_channels_last
    echo "--- train_bf16_channels_last" >> "$train_log"
    mark "$train_log"
    bounded "$train_log" "$py" "${demo[@]}" output_dir="$work/runs/train_bf16_channels_last" "${size_args[@]}" \
      train.amp=auto model.channels_last=auto train.iters=20 train.val_interval=20 train.ckpt_interval=20
    # what ran, as the log says it: "train.amp=auto: bf16 (...)" and "model.channels_last=auto: on"
    layout=$(section "$train_log" | grep -oE '(train\.amp=auto: [a-z0-9]+|model\.channels_last=auto: [a-z]+)' | paste -sd ',' -)
    val=$(add_metrics train_bf16_channels_last "$work/runs/train_bf16_channels_last" 2>> "$train_log")
    verdict train_bf16_channels_last "20 iterations; ${layout:-no precision line}${val:+; $val}"
  fi

  # fp16 + GradScaler + fused AdamW, resumed from the checkpoint an unfused optimizer would have written: torch
  # moves a loaded step to the parameter's device only when the saved group was fused (issue 30)
  name=train_fp16_resume run=$work/runs/train_fp16_resume
  if ! selected $name; then not_run $name "$unselected_reason"; else
  begin $name
  echo "--- $name: first part" >> "$train_log"
  bounded "$train_log" "$py" "${demo[@]}" output_dir="$run" "${size_args[@]}" "${fp16_first[@]}"
  detail="first part"
  if [ "$rc" -eq 0 ]; then
    echo "--- $name: last.pt as the unfused optimizer saved it" >> "$train_log"
    mark "$train_log"
    bounded "$train_log" "$py" -m scripts.gpu_probes unfuse "$run/last.pt"
    detail="unfuse"
    if [ "$rc" -eq 0 ]; then
      unfused=$(section "$train_log" | grep '^RESULT: ' | tail -n 1 | cut -c9-)
      echo "--- $name: the resume" >> "$train_log"
      bounded "$train_log" "$py" "${demo[@]}" --resume auto output_dir="$run" "${size_args[@]}" "${fp16_resume[@]}"
      detail="resume; $unfused"
      [ "$rc" -eq 0 ] && detail="10 iterations fp16 + GradScaler + fused AdamW, resumed to 20 from last.pt made unfused"
    fi
  fi
  took=$((SECONDS - step_start))
  val=$(add_metrics "$name" "$run" 2>> "$train_log")
  verdict "$name" "$detail${val:+; $val}" "no CUDA device; 1 fp32 CPU iteration, its last.pt made unfused, resumed to 2"
  fi

  # full fp32 (TF32 off) stopped by SIGTERM mid-step: exit 143, last.pt saved, the stop line
  if ! selected train_off_sigterm; then not_run train_off_sigterm "$unselected_reason"; else
  probe train_off_sigterm "$train_log" "no CUDA device; the same on the CPU" sigterm -- "${demo[@]:1}" \
    output_dir="$work/runs/train_off_sigterm" "${size_args[@]}" train.amp=off train.iters=2000 train.log_interval=1 \
    train.val_interval=5000 train.ckpt_interval=5000
  add_metrics train_off_sigterm "$work/runs/train_off_sigterm" > /dev/null 2>> "$train_log"
  fi
fi
needs_deps bad_mask && probe bad_mask "$train_log" "no CUDA device; the same on the CPU" bad-mask --device $probe_device -- \
  "${demo[@]:1}" output_dir="$work/runs/bad_mask" "${size_args[@]}" train.iters=5
probe tf32 "$probes_log" "no CUDA device; measured on the CPU" tf32 --device $probe_device

# ---------------------------------------------------------------------------------------------- cuda_tests
# One pytest run per file that declares CUDA tests (marker `cuda`): a collection error (a missing
# requirement) or a crash costs that file alone. The files share the step's slice.
mapfile -t cuda_tests < <(grep -rl "mark.cuda" tests --include='test_*.py' | sort)
echo "CUDA test files: ${cuda_tests[*]}" >> "$tests_log"
if [ ${#cuda_tests[@]} -eq 0 ]; then record FAIL 0 cuda_tests "no test file declares mark.cuda under tests/"; fi
begin cuda_tests
for file in "${cuda_tests[@]}"; do
  step="cuda_tests:${file#tests/}"
  if ! selected cuda_tests; then unselected "$step"; continue; fi
  step_start=$SECONDS
  mark "$tests_log"
  bounded "$tests_log" "$py" -m pytest -q -m cuda -p no:cacheprovider -o addopts= -o timeout=60 -rA "$file"
  section=$(section "$tests_log")
  # pytest's closing line; else (pytest did not get that far) the last error line, else the last line
  outcome=$(echo "$section" | grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)|no tests ran' | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  outcome=${outcome:-$(echo "$section" | grep -E '^E ' | tail -n 1 | sed -E 's/^E +//')}
  outcome=${outcome:-$(echo "$section" | grep -v '^[[:space:]]*$' | tail -n 1)}
  if [ "$rc" -eq 0 ] && ! echo "$outcome" | grep -q passed; then
    record SKIPPED "$took" "$step" "${outcome:-no outcome line}$([ $dry_run = 1 ] && echo ' (dry run: no CUDA device)'); the reasons are in cuda_tests.txt"
  elif [ "$rc" -eq 5 ]; then
    record SKIPPED "$took" "$step" "no test marked cuda was collected"
  else
    verdict "$step" "$outcome"
  fi
done

echo "finished with status $status in ${SECONDS} s: $counts_pass passed, $counts_fail failed or timed out, $counts_skip skipped$([ $dry_run = 1 ] && echo ' (dry run)')" >> "$summary"
echo
cat "$summary"
echo "results in $out"
exit $status
