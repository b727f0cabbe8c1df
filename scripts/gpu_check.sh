#!/usr/bin/env bash
# One prepared GPU check for the CUDA target (written for a lent NVIDIA H200 machine, no internet).
#
#   bash scripts/gpu_check.sh [--skip-model] [--budget-seconds N]
#   WHEELS=/path/to/wheels bash scripts/gpu_check.sh     # where pip finds packages offline
#   TVM_OFFLINE_PARTS="/tmp/p .tvm_offline" bash scripts/gpu_check.sh   # TVM in parts: pack_tvm_offline.py
#
# 1. makes tvm_llm importable (pip install -e . from local wheels if it is not);
# 2. makes TVM's CUDA runtime loadable (libcudart.so.13 on LD_LIBRARY_PATH if it is elsewhere);
# 3. runs scripts/gpu_check.py under a hard time limit (default 470 s: the check is sized to
#    finish within 8 minutes). Figures go to stdout and, when $OUT is set, $OUT/gpu_check.json.
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
LIMIT=${GPU_CHECK_LIMIT:-470}
step() { echo "[gpu_check.sh] $*"; }

step "python: $($PY --version 2>&1) at $(command -v $PY)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# -- 1. tvm_llm importable -----------------------------------------------------------------
# TVM carried in parts (scripts/pack_tvm_offline.py): TVM_OFFLINE_PARTS="/tmp/p .tvm_offline"
if [ -n "${TVM_OFFLINE_PARTS:-}" ] && ! $PY -c "import tvm" 2>/dev/null; then
    # shellcheck disable=SC2086
    $PY scripts/pack_tvm_offline.py unpack --parts $TVM_OFFLINE_PARTS --site /tmp/tvm_site || exit 2
    export PYTHONPATH="/tmp/tvm_site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! $PY -c "import tvm_llm, tvm" 2>/dev/null; then
    step "tvm_llm (or tvm) is not importable: installing the repo in editable mode"
    FIND=()
    for d in "${WHEELS:-}" "$REPO/wheels" "$REPO/shared/wheels" /wheels; do
        [ -n "$d" ] && [ -d "$d" ] && FIND+=(--find-links "$d")
    done
    if [ ${#FIND[@]} -gt 0 ]; then
        $PY -m pip install --no-index "${FIND[@]}" -e . || $PY -m pip install -e . --no-deps
    else
        $PY -m pip install -e . || $PY -m pip install -e . --no-deps
    fi
    if ! $PY -c "import tvm_llm, tvm" 2>/dev/null; then
        step "FAILED to make tvm_llm importable. Steps:"
        step "  1. copy wheels for setup.py's install_requires (apache-tvm==0.27.0.post1,"
        step "     apache-tvm-ffi==0.1.14.post1, transformers, safetensors, tokenizers, numpy, ziglang)"
        step "     into ./wheels, then: WHEELS=./wheels bash scripts/gpu_check.sh"
        step "  2. or: pip install --no-index --find-links <dir> -e .   and rerun"
        exit 2
    fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# -- 2. TVM's CUDA runtime loadable ---------------------------------------------------------
# libtvm_runtime_cuda.so links libcudart.so.13 and the driver's libcuda.so.1; without them
# tvm.cuda().exist is False. Look for a CUDA 13 runtime where toolkits and pip wheels put it.
TVM_LIB=$($PY -c "import os, tvm; print(os.path.join(os.path.dirname(tvm.__file__), 'lib'))")
missing=$(ldd "$TVM_LIB/libtvm_runtime_cuda.so" 2>/dev/null | awk '/not found/ {print $1}' | grep -v tvm_ffi)
if echo "$missing" | grep -q cudart; then
    SITE=$($PY -c "import site; print(' '.join(site.getsitepackages()))")
    for d in /usr/local/cuda*/lib64 /usr/local/cuda*/lib /usr/lib/x86_64-linux-gnu \
             $(for s in $SITE; do echo $s/nvidia/cu13/lib $s/nvidia/cuda_runtime/lib; done); do
        if [ -e "$d/libcudart.so.13" ]; then
            step "using libcudart.so.13 from $d"
            export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            break
        fi
    done
fi
missing=$(ldd "$TVM_LIB/libtvm_runtime_cuda.so" 2>/dev/null | awk '/not found/ {print $1}' | grep -v tvm_ffi)
if [ -n "$missing" ]; then
    step "TVM's CUDA runtime still misses: $missing"
    step "  install a CUDA 13 runtime (the nvidia-cuda-runtime wheel for CUDA 13, or the toolkit)"
    step "  and put the directory holding libcudart.so.13 on LD_LIBRARY_PATH; libcuda.so.1 comes"
    step "  with the NVIDIA driver. The kernel and model checks will report the failure."
fi
$PY -c "import tvm; d = tvm.cuda(0); print('[gpu_check.sh] tvm.cuda(0).exist =', d.exist)"
command -v nvcc >/dev/null || step "nvcc not on PATH: builds use NVRTC (needs the cuda-bindings package)"

# -- 3. the check ---------------------------------------------------------------------------
export TOKENIZERS_PARALLELISM=false
timeout --signal=INT --kill-after=15 "$LIMIT" $PY scripts/gpu_check.py "$@"
status=$?
[ $status -eq 124 ] && step "stopped at the ${LIMIT}s limit"
exit $status
