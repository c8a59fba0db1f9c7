#!/usr/bin/env bash
# The benchmarks on one CUDA machine, every result in one folder, in under 3 minutes.
#
#   bash benchmarks/gpu.sh [OUT_DIR]      (default: benchmarks/results/gpu-<UTC time>)
#
# Needs the CUDA builds of torch, tensorflow and jax, and unimp importable (pip install -e .,
# or run from the repository root: the workers put it first on PYTHONPATH). PYTHON overrides
# the interpreter. Each step has its own time limit, cut to what is left of the whole run's
# TOTAL_S (170 s: under 3 minutes with the kill grace), so one stuck framework cannot eat the
# others' time; a failed or cut step is logged and the next one runs. Every script writes its
# table as it goes (gemm per precision budget, memory after each configuration), so a step
# cut short still leaves what it measured. Order: what the issue's targets need first.
# benchmarks.speedup (float32 vs mixed, through unimp) is left out: the GEMM probe measures
# the same recipes on a GEMM-bound model, as TFLOP/s; run it on its own when wanted.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
PY="${PYTHON:-python}"
TOTAL_S=170
mkdir -p "$OUT"
start=$SECONDS

{ timeout 5 nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
timeout 10 "$PY" -m unimp.cli info > "$OUT/unimp-info.txt" 2>&1 || true

run() {  # run NAME LIMIT_S [ARGS...]
    local name=$1 limit=$2 left
    shift 2
    left=$((TOTAL_S - (SECONDS - start)))
    if ((left < 10)); then
        echo "== $name skipped: ${left}s left of ${TOTAL_S}s"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s, at $((SECONDS - start))s)"
    if ! timeout -k 3 "$limit" "$PY" -m "benchmarks.$name" --device cuda --out "$OUT" "$@" \
        > "$OUT/$name.log" 2>&1; then
        echo "   $name failed or timed out: see $OUT/$name.log"
    fi
}

# host syncs: set_sync_debug_mode("error"), compilations, transfer guard, tracings
run syncs 25 --quick
# 4 x Dense(8192), batch 8192: TFLOP/s and share of the dense peak; bfloat16 and float8 (the
# native float8 GEMMs, fp8-delayed) first, the issue's comparison; each backend starts no new
# precision 10 s after its import (one in progress may finish)
run gemm 60 --budget-s 10 --precisions bfloat16,float8,float16,tf32,float32
# the native float8 paths' scaling states against the emulated reference on the same maxima,
# and whether a float8 GEMM ran: one PASS / FAIL line per framework (copied below)
run fp8check 25 --backends torch,jax,tensorflow
# unimp / native (mixed_float16), the seeds' MLP, 4 pairs of 0.25 s trials per build order
run overhead 30 --quick --models mlp
# torch.cuda.max_memory_allocated / JAX peak_bytes_in_use / TF peak, unimp and native
run memory 30 --quick --recipes mixed_bfloat16 --loops unimp,native

# one line per framework, as each worker ended (a framework cut by the limit has none)
grep -oE "(PASS|FAIL) (torch|tensorflow|jax|\?):.*" "$OUT/fp8check.log" 2>/dev/null | sort -u \
    || echo "FAIL fp8check: no result (see $OUT/fp8check.log)"

echo "done in $((SECONDS - start))s; results in $OUT:"
ls "$OUT"
