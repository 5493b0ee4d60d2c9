#!/usr/bin/env bash
# GPU-sharing benchmark on one real GPU, in under 5 minutes: the same 8 small trials swept with
# `gpu_share: auto` (probe -> trials per GPU -> memory caps) and with whole-GPU trials, side by side in one run.
# Before it, bench/fsdp_gpu.py checks one FSDP2 step (NCCL, bf16) and a DCP save/load on the device.
# Prints trials per hour, mean GPU utilization (nvidia-smi), OOM retries and errors of each, and the speedup.
#
#   bench/packing_gpu.sh            # on a CUDA machine with the project's venv (CUDA build of torch)
#   DRY=1 bench/packing_gpu.sh      # CPU dry run on logical GPUs: declared 2 GB trials on a 16 GB logical GPU
#
# Results go to $OUT/packing_gpu.json when OUT is set (the device tool's output folder), else to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export RAY_AUTH_MODE=disabled
export ELASTIC_HOME=${ELASTIC_HOME:-$(mktemp -d /tmp/elastic-bench-gpu-XXXX)}
TRIALS=${TRIALS:-8}
if [[ "${DRY:-0}" == "1" ]]; then
  STEPS=${STEPS:-40}; EXTRA=(--gpu-memory-gb 2); TRIALS=${TRIALS_DRY:-4}
else
  STEPS=${STEPS:-2000}; EXTRA=()
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA: use DRY=1 on CPU")'
  nvidia-smi --query-gpu=name,memory.total,utilization.gpu --format=csv
fi
# FSDP2 + NCCL + bf16 on the device first: a sharded step, a DCP save and an exact load (fsdp_gpu.json).
"$PY" bench/fsdp_gpu.py
cleanup() { "$PY" -m elastic local down >/dev/null 2>&1 || true; }
trap cleanup EXIT
# one on-demand worker node with the machine's GPU (or a logical one on CPU) and all its CPUs
"$PY" -m elastic local up --spot 0 --on-demand 1 --gpus-per-node 1 --cpus-per-node "$(nproc)" --json >/dev/null
RESULT=$(timeout 270 "$PY" -m elastic bench packing --compare --trials "$TRIALS" --steps "$STEPS" \
         --width 1024 --batch 256 "${EXTRA[@]}" --json)
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT" && echo "$RESULT" > "$OUT/packing_gpu.json"
fi
echo "$RESULT"
