#!/usr/bin/env bash
# QuACK (quack-kernels, the CuTe-DSL GEMM library SonicMoE is built on) as a peer of
# `python -m megamoe.bench.engine` on a lent GPU machine, which has no network. Its DSL
# library (the CUDA 13 libs wheel, 92 MB) is over the device tool's 64 MiB carry limit even
# repacked with xz (61 MiB), with the working tree beside it, so it travels in two halves,
# one per call, and is joined on the machine (a warm machine keeps /tmp between calls).
#
#   bash tools/quack_peer.sh prepare            here (network): fills .quack/{half1,half2,wheels}
#   bash tools/quack_peer.sh carry              on the machine, calls 1 and 2 (carry .quack/half1,
#                                               then .quack/half2): keeps the half; joins and
#                                               unpacks once both are there
#   bash tools/quack_peer.sh bench OUT_DIR [ARGS...]
#                                               on the machine, call 3 (carry .quack/wheels and
#                                               .whl): builds the checkout if megamoe is not
#                                               installed, then runs the engine bench beside
#                                               torch and QuACK (ARGS go to it; default
#                                               --sustained 10 --iters 5 --warmup 2), the JSON
#                                               and the log into OUT_DIR
#
# The three calls must follow each other within the machine's idle release. .quack/ is
# ignored by git. The pins are those the engine bench was written against (quack-kernels
# 0.6.5 with nvidia-cutlass-dsl 4.8.1).
set -euo pipefail

usage="usage: tools/quack_peer.sh prepare | carry | bench OUT_DIR [ARGS...]"
root=$(cd "$(dirname "$0")/.." && pwd)
peer=$root/.quack
site=${QUACK_PEER_SITE:-/tmp/megamoe-quack} # on the machine: the halves, then the packages
step=${1:-}
[ $# -gt 0 ] && shift

prepare() {
  local plat=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  mkdir -p "$peer/wheels" "$peer/half1" "$peer/half2"
  python3 -m pip download -q "${plat[@]}" -d "$peer/wheels" quack-kernels==0.6.5 \
    nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 "apache-tvm-ffi>=0.1.6,<0.2" torch-c-dlpack-ext einops
  if [ ! -s "$peer/half1/libs.part" ] || [ ! -s "$peer/half2/libs.part" ]; then
    local tmp
    tmp=$(mktemp -d)
    python3 -m pip download -q "${plat[@]}" -d "$tmp/dl" nvidia-cutlass-dsl-libs-cu13==4.8.1
    mkdir -p "$tmp/x"
    (cd "$tmp/x" && python3 -m zipfile -e "$tmp"/dl/*.whl . && tar -cf - . | xz -9 -T2 >"$tmp/libs.tar.xz")
    split -n 2 -d "$tmp/libs.tar.xz" "$tmp/part."
    mv "$tmp/part.00" "$peer/half1/libs.part"
    mv "$tmp/part.01" "$peer/half2/libs.part"
    rm -rf "$tmp"
  fi
  du -sh "$peer"/*
}

carry() {
  mkdir -p "$site/parts"
  local half carried=0
  for half in 1 2; do
    if [ -s "$peer/half$half/libs.part" ]; then
      cp "$peer/half$half/libs.part" "$site/parts/$half"
      echo "half $half kept in $site/parts"
      carried=1
    fi
  done
  if [ "$carried" = 0 ] && [ ! -d "$site/packages/nvidia_cutlass_dsl" ]; then
    echo "no half in $peer/half1 or $peer/half2: name one in the call's carry" >&2
    exit 2
  fi
  if [ -s "$site/parts/1" ] && [ -s "$site/parts/2" ]; then
    mkdir -p "$site/packages"
    cat "$site/parts/1" "$site/parts/2" | tar -xJ -C "$site/packages"
    rm -rf "$site/parts"
    echo "DSL library unpacked into $site/packages"
  fi
}

bench() {
  [ $# -ge 1 ] || {
    echo "$usage" >&2
    exit 2
  }
  local out=$1
  shift
  [ -d "$site/packages/nvidia_cutlass_dsl" ] || {
    echo "no DSL library in $site/packages: run 'carry' with each half first" >&2
    exit 2
  }
  compgen -G "$peer/wheels/*.whl" >/dev/null || {
    echo "no wheels in $peer/wheels: carry .quack/wheels in this call" >&2
    exit 2
  }
  local wheel
  for wheel in "$peer"/wheels/*.whl; do
    python3 -m zipfile -e "$wheel" "$site/packages" >/dev/null
  done
  mkdir -p "$out"
  out=$(cd "$out" && pwd) # the bench runs from /tmp
  if ! (cd /tmp && python3 -c 'import megamoe') 2>/dev/null; then
    # The build requirements the image lacks come as wheels in .whl/ (tools/lease_prep.sh).
    compgen -G "$root/.whl/*.whl" >/dev/null || {
      echo "megamoe is not installed and $root/.whl has no wheels: carry .whl" >&2
      exit 2
    }
    local build_site
    build_site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --target "$build_site" "$root"/.whl/*.whl
    (cd "$root" && PYTHONPATH=$build_site CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      python3 -m pip install -q --no-build-isolation --no-deps .) >"$out/build.log" 2>&1 || {
      tail -30 "$out/build.log"
      exit 1
    }
  fi
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--sustained 10 --iters 5 --warmup 2)
  export PYTHONPATH=$site/packages:$site/packages/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  cd /tmp # the installed megamoe, not the source tree
  python3 -c 'from quack.gemm_interface import gemm' # fails loudly if QuACK cannot load
  python3 -m megamoe.bench.engine "${args[@]}" --json "$out/engine.json" 2>&1 | tee "$out/engine.log"
}

case "$step" in
  prepare) prepare ;;
  carry) carry ;;
  bench) bench "$@" ;;
  -h | --help) echo "$usage" ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
