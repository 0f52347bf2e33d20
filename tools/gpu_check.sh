#!/usr/bin/env bash
# make gpu-check: the checks that need a CUDA GPU, in one prepared run (< 8 minutes), results in a folder.
#   1. the tests marked gpu;
#   2. cpkv run --device cuda --check (triton kernels) for Llama and DeepSeek-V3.2;
#   3. cpkv bench kv on the GPU at 32K and 128K tokens, store and translated read vs index_copy_/index_select;
#   4. cpkv bench splits on the GPU, prefill 32K tokens, decode contexts 32K and 128K.
# Usage: tools/gpu_check.sh [OUT_DIR]   (default gpu-check/, ignored by git; PY selects the interpreter)
# Without CUDA it stops at once with exit code 2 and says why; a failed step exits 1 after the others ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
PY=${PY:-python}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu-check: needs a CUDA GPU, and torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable')) sees none here; nothing was run" >&2
    exit 2
fi
mkdir -p "$OUT"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
CP=$(( GPUS < 4 ? GPUS : 4 ))
"$PY" -c "import torch; print(torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda)" > "$OUT/device.txt"
failed=0
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, output to OUT/NAME.txt
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $(( SECONDS - t0 )) s" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || failed=1
}
: > "$OUT/summary.txt"
step tests 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests
for m in llama deepseek-v3.2; do
    step "run-$m" 60 "$PY" -m cpkv run --device cuda --cp 1 --model "$m" --check --json --no-progress
done
for n in 32768 131072; do
    step "bench-kv-$n-triton" 30 "$PY" -m cpkv bench kv --device cuda --kernels triton --tokens $n --repeats 11
    step "bench-kv-$n-torch" 30 "$PY" -m cpkv bench kv --device cuda --kernels torch --tokens $n --repeats 11
done
step bench-splits-32k 60 "$PY" -m cpkv bench splits --device cuda --cp "$CP" --model llama --tokens 32768 \
    --context 32768 --decode-bs 4 --repeats 2 --json
step bench-splits-128k 60 "$PY" -m cpkv bench splits --device cuda --cp "$CP" --model llama --tokens 32768 \
    --context 131072 --decode-bs 2 --repeats 2 --json
echo "gpu-check: results in $OUT/ (summary.txt)"
exit $failed
