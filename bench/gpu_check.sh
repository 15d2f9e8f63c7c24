#!/usr/bin/env bash
# Every GPU check in one go, for a machine with CUDA (one short lease): the CUDA tests, then the GPU load
# benchmark. Run from the repository root with torch (CUDA build), diffusers and transformers importable;
# dduf_plus is taken from the checkout. Logs and bench/gpu_load.py's JSON go to $OUT (else bench/results).
#
#   bash bench/gpu_check.sh [RUNS]
set -u
RUNS=${1:-3}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, diffusers, transformers, dduf_plus; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" || exit 1

echo "=== CUDA tests"
python3 -m pytest -q -p no:cacheprovider -rs -o addopts="" tests/test_transfer.py tests/test_save.py \
  tests/test_load_errors.py tests/test_bench_gpu_load.py tests/test_empty_init.py > "$DEST/gpu_tests.log" 2>&1 || status=1
tail -25 "$DEST/gpu_tests.log"

echo "=== GPU load benchmark"
python3 bench/gpu_load.py --runs "$RUNS" --work "${GPU_WORK:-/tmp/dduf-gpu-work}" --json "$DEST/gpu_load.json" \
  2>&1 | tee "$DEST/gpu_load.log" || status=1
exit $status
