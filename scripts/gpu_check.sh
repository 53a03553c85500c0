#!/usr/bin/env bash
# The PyTorch engine on a CUDA GPU (not part of CI: CI has no GPU).
#
# 1. Its tests with DYN_TEST_DEVICE=cuda: the engine and transformers' reference both on the GPU
#    (greedy output equal to `generate`, logprobs, preemption, prefix caching, cancellation,
#    guided decoding, the disaggregated hand-off between two engines), then served over HTTP in
#    one process and as worker processes (aggregated and disaggregated, KV pulled between GPUs).
# 2. benchmarks/pytorch_engine.py on the GPU: the tiny fp32 Llama, then a Llama-3.2-1B-shaped
#    model (random weights) in bf16, each against transformers' `generate` on the same GPU.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default: $OUT, else bench-results/gpu)
# Wheels for packages the GPU machine lacks may be put in .whl/; they are installed to /tmp/site.
set -uo pipefail
out=${1:-${OUT:-bench-results/gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
# Our C extensions, built for this machine's Python when its headers are there (else the
# pure-Python twins run, as with DYN_NATIVE=0).
if $py -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))'; then
    $py -c 'from setuptools import setup; setup()' build_ext --inplace -q >"$out/build.log" 2>&1 \
        && echo "C extensions built" || echo "C extensions not built (see build.log)"
fi
nvidia-smi -L | tee "$out/device.txt"
$py -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' \
    | tee -a "$out/device.txt"
status=0
# -W default: the machine's library versions differ from our pins; their deprecation warnings
# are reported, not errors (the CPU suite keeps warnings as errors).
DYN_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-300}" $py -m pytest -q -p no:cacheprovider \
    -W default tests/unit/pytorch tests/integration/test_pytorch_http.py \
    tests/e2e/test_pytorch_process.py tests/e2e/test_pytorch_disagg_processes.py 2>&1 | tee "$out/tests.log" || status=1
bench() {  # name, then the benchmark's arguments
    local name=$1
    shift
    timeout "${BENCH_TIMEOUT:-200}" $py -m benchmarks.pytorch_engine --device cuda "$@" 2>&1 \
        | tee "$out/bench_$name.log" || status=1
    cp bench-results/pytorch_engine.json "$out/bench_$name.json" 2>/dev/null
}
bench tiny --concurrency 1 8 32
bench 1b --size 1b --dtype bfloat16 --concurrency 1 32 128 --requests-scale 4
exit $status
