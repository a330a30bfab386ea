#!/usr/bin/env bash
# GPU checks: every CUDA test and the GPU benchmarks, within 8 minutes on a GPU machine (each step has
# its own timeout; they add up to 470 s).
#   scripts/gpu_check.sh OUTPUT_DIR
# Writes under OUTPUT_DIR: environment.txt, cuda_tests.txt (pytest output), bench_syncbn_cuda.{txt,json},
# bench_cuda.{txt,json} (SyncBN vs torch.nn.SyncBatchNorm and nn.BatchNorm2d, 1 and 2 processes; training
# images/s and peak memory, fp32 vs fp16 + channels_last), train_gpu0.txt, train_ddp2.txt.
# Uses $PYTHON, else .venv/bin/python when it exists, else python3 (the GPU machine's own PyTorch).
set -uo pipefail
usage() {
  cat <<'EOF_USAGE'
usage: scripts/gpu_check.sh OUTPUT_DIR
Runs every CUDA test, the CUDA SyncBN benchmarks (bench_syncbn, bench_cuda: layers and training
throughput), a 60-iteration --gpus 0 fp16 training of the demo and, with 2 GPUs, a 2-process torchrun
training; writes logs and JSON under OUTPUT_DIR (created if needed). About 8 minutes at most.
Python: $PYTHON, else .venv/bin/python when it exists, else python3. Exit status 0 when every step passed.
EOF_USAGE
}
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
  -*) echo "gpu_check.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then echo "gpu_check.sh: one OUTPUT_DIR expected, got $#" >&2; usage >&2; exit 2; fi
out=$1
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONUNBUFFERED=1
status=0

{ date -u; nvidia-smi || true; "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; } \
  > "$out/environment.txt" 2>&1

# Every test file that declares CUDA tests (marker `cuda`); only those modules are imported, so the
# GPU machine needs torch alone for the sync_batchnorm checks.
mapfile -t cuda_tests < <(grep -rl "mark.cuda" tests --include='test_*.py' | sort)
echo "CUDA test files: ${cuda_tests[*]}" | tee "$out/cuda_tests.txt"
timeout 120 "$py" -m pytest -q -m cuda -p no:cacheprovider -o addopts="" "${cuda_tests[@]}" -rA \
  2>&1 | tee -a "$out/cuda_tests.txt" || status=1

timeout 60 "$py" -m benchmarks.bench_syncbn --device cuda --skip-distributed --repeats 30 \
  --output "$out/bench_syncbn_cuda.json" 2>&1 | tee "$out/bench_syncbn_cuda.txt" || status=1

# SyncBN against torch.nn.SyncBatchNorm / nn.BatchNorm2d on the three shapes (one process; two with NCCL
# when there are 2 GPUs), then training images/s and peak memory, fp32 vs fp16 autocast + channels_last.
timeout 150 "$py" -m benchmarks.bench_cuda --repeats 30 --train-iters 20 --train-rounds 2 \
  --output "$out/bench_cuda.json" 2>&1 | tee "$out/bench_cuda.txt" || status=1

# Training (issue 6): 60 iterations of the demo on GPU 0 with fp16 AMP + GradScaler, then the same as
# a 2-process torchrun (NCCL, SyncBN through torch.distributed) when there are 2 GPUs. Needs the
# runtime requirements (albumentations, tensorboard, ...), not only torch.
train_args=(train.iters=60 train.amp=fp16 train.val_interval=60 train.ckpt_interval=60 train.log_interval=20
            data.num_workers=4 data.synthetic_train_size=1000 data.synthetic_val_size=50)
if "$py" -c "import albumentations, cv2, tensorboard, yaml" 2>/dev/null; then
  timeout 70 "$py" train.py --config demo.yaml --gpus 0 output_dir="$out/train_gpu0" "${train_args[@]}" \
    2>&1 | tee "$out/train_gpu0.txt" || status=1
  if [ "$("$py" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 timeout 70 "$py" -m torch.distributed.run --standalone --nproc_per_node 2 \
      train.py --config demo.yaml \
      output_dir="$out/train_ddp2" "${train_args[@]}" 2>&1 | tee "$out/train_ddp2.txt" || status=1
  else
    echo "train: 1 GPU, 2-process torchrun skipped" | tee "$out/train_ddp2.txt"
  fi
else
  echo "train: FAILED to import the runtime requirements (pip install -r requirements.txt)" | tee "$out/train_gpu0.txt"
  status=1
fi

echo "gpu_check finished with status $status; results in $out"
exit $status
