#!/usr/bin/env bash
# Every benchmark on one CUDA machine, every result in one folder, in under 8 minutes.
#
#   bash benchmarks/gpu.sh [OUT_DIR]      (default: benchmarks/results/gpu-<UTC time>)
#
# Needs the CUDA builds of torch, tensorflow and jax, and unimp importable (pip install -e .,
# or run from the repository root: the workers put it first on PYTHONPATH). PYTHON overrides
# the interpreter. Each step has its own time limit (total at most 7.5 min) so one stuck
# framework cannot eat the others' time; a failed step is logged and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
start=$SECONDS

{ nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
timeout 60 "$PY" -m unimp.cli info > "$OUT/unimp-info.txt" 2>&1 || true

run() {  # run NAME LIMIT_S [ARGS...]
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s, at $((SECONDS - start))s)"
    if ! timeout -k 10 "$limit" "$PY" -m "benchmarks.$name" --device cuda --out "$OUT" "$@" \
        > "$OUT/$name.log" 2>&1; then
        echo "   $name failed or timed out: see $OUT/$name.log"
    fi
}

run syncs 60                 # host syncs: set_sync_debug_mode("error"), compilations, tracings
run overhead 170 --quick     # unimp / native (mixed_float16), mlp, wide and tiny, 8 pairs of 0.25 s trials
run speedup 70               # float32 vs mixed_float16 vs mixed_bfloat16, 4x4096 MLP, batch 2048
run memory 150 --quick       # one process per backend x recipe (unimp's step)

echo "done in $((SECONDS - start))s; results in $OUT:"
ls "$OUT"
