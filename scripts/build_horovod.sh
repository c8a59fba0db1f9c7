#!/usr/bin/env bash
# Build Horovod 0.28.1 (its last release, June 2023) for the installed torch and TensorFlow, CPU,
# Gloo, no MPI.
#
# Why a script: `pip install horovod` fails against current frameworks, for two reasons:
#  - the 0.28.1 source release compiles as C++14, but torch >= 2.1 and TensorFlow >= 2.16 headers
#    need C++17: we raise CMAKE_CXX_STANDARD 14 -> 17 in the top-level, horovod/torch and
#    horovod/tensorflow CMakeLists;
#  - horovod/tensorflow/xla_mpi_ops.cc (Horovod's XLA custom calls, used only on GPUs with
#    HOROVOD_ENABLE_XLA_OPS) includes XLA headers that the TensorFlow wheel ships without their
#    dependencies (TensorFlow 2.21: "xla/printer.h: fatal error: highwayhash/arch_specific.h: No
#    such file or directory"): we leave that one file out of the CPU build.
# The wheel is built against the torch and TensorFlow of $PYTHON (no build isolation, so those are
# the ones it links against) and, optionally, installed into a separate venv that sees $PYTHON's
# packages through a .pth file (the framework env itself is left untouched). A framework $PYTHON
# lacks is left out of the build. About 10-15 minutes on 2 cores (11 with MAX_JOBS=1, torch 2.13
# and TensorFlow 2.21).
#
# Usage:
#   scripts/build_horovod.sh [WHEEL_DIR] [VENV_DIR]
#   PYTHON=/path/to/python   the interpreter whose torch and TensorFlow Horovod is built for
#                            (default: python3)
#   MAX_JOBS=N               parallel compile jobs (default: nproc)
# Then, e.g.:
#   VENV_DIR/bin/horovodrun -np 2 -H localhost:2 --gloo VENV_DIR/bin/python examples/distributed/horovod_torch.py
#   VENV_DIR/bin/horovodrun -np 2 -H localhost:2 --gloo VENV_DIR/bin/python examples/distributed/horovod_tensorflow.py
set -euo pipefail

PYTHON=${PYTHON:-python3}
WHEEL_DIR=${1:-$PWD/hvd-wheel}
VENV_DIR=${2:-}
VERSION=0.28.1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m pip download "horovod==$VERSION" --no-binary :all: --no-deps -d "$WORK"
tar -xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/horovod-$VERSION"

# C++14 -> C++17 where Horovod sets it for itself and for its torch and TensorFlow extensions.
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt" "$SRC/horovod/tensorflow/CMakeLists.txt"
grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/CMakeLists.txt"
grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/horovod/torch/CMakeLists.txt"
# The XLA custom-call ops out of the CPU build (see above).
sed -i '\|horovod/tensorflow/xla_mpi_ops.cc|d' "$SRC/horovod/tensorflow/CMakeLists.txt"
! grep -q 'xla_mpi_ops.cc' "$SRC/horovod/tensorflow/CMakeLists.txt"

# each framework $PYTHON has; at least one
WITH_TORCH=0 WITH_TF=0
"$PYTHON" -c 'import torch' 2>/dev/null && WITH_TORCH=1
"$PYTHON" -c 'import tensorflow' 2>/dev/null && WITH_TF=1
if [ "$WITH_TORCH$WITH_TF" = 00 ]; then
    echo "build_horovod.sh: $PYTHON has neither torch nor tensorflow; install one first." >&2
    exit 1
fi
if [ $WITH_TORCH = 1 ]; then export HOROVOD_WITH_PYTORCH=1; else export HOROVOD_WITHOUT_PYTORCH=1; fi
if [ $WITH_TF = 1 ]; then export HOROVOD_WITH_TENSORFLOW=1; else export HOROVOD_WITHOUT_TENSORFLOW=1; fi
export HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo
export MAKEFLAGS="-j${MAX_JOBS:-$(nproc)}"
mkdir -p "$WHEEL_DIR"
"$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$WHEEL_DIR" "$SRC"

if [ -n "$VENV_DIR" ]; then
    # A plain venv from the same base interpreter; $PYTHON's site-packages (torch, unimp, ...)
    # are appended to its path by a .pth file, so nothing is installed into $PYTHON's env.
    BASE=$("$PYTHON" -c 'import sys; print(sys.base_prefix)')
    "$BASE/bin/python3" -m venv "$VENV_DIR"
    SITE=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    VSITE=$("$VENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$SITE" > "$VSITE/_base_env.pth"
    "$VENV_DIR/bin/python" -m pip install --no-deps --no-index "$WHEEL_DIR"/horovod-$VERSION-*.whl
    [ $WITH_TORCH = 0 ] || "$VENV_DIR/bin/python" -c 'import horovod, horovod.torch as hvd; print("horovod", horovod.__version__, "torch, gloo built:", hvd.gloo_built())'
    [ $WITH_TF = 0 ] || "$VENV_DIR/bin/python" -c 'import horovod, horovod.tensorflow as hvd; print("horovod", horovod.__version__, "tensorflow, gloo built:", hvd.gloo_built())'
fi
