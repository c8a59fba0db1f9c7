#!/usr/bin/env bash
# Build Horovod 0.28.1 (its last release, June 2023) for the installed torch, CPU, Gloo, no MPI.
#
# Why a script: the 0.28.1 source release compiles as C++14 but current torch headers need C++17,
# so `pip install horovod` fails against torch >= 2.1. We raise CMAKE_CXX_STANDARD 14 -> 17 in the
# top-level and horovod/torch CMakeLists, build a wheel against the torch of $PYTHON (no build
# isolation, so that torch is the one the wheel links against) and, optionally, install the wheel
# into a separate venv that sees $PYTHON's packages through a .pth file (the framework env itself
# is left untouched).  Takes about 7-10 minutes on 2 cores.
#
# Usage:
#   scripts/build_horovod.sh [WHEEL_DIR] [VENV_DIR]
#   PYTHON=/path/to/python   the interpreter whose torch Horovod is built for (default: python3)
#   MAX_JOBS=N               parallel compile jobs (default: nproc)
# Then, e.g.:
#   VENV_DIR/bin/horovodrun -np 2 -H localhost:2 --gloo VENV_DIR/bin/python examples/distributed/horovod_torch.py
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

# C++14 -> C++17 where Horovod sets it for itself and for its torch extension.
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/CMakeLists.txt"
grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/horovod/torch/CMakeLists.txt"

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
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
    "$VENV_DIR/bin/python" -c 'import horovod, horovod.torch as hvd; print("horovod", horovod.__version__, "gloo built:", hvd.gloo_built())'
fi
