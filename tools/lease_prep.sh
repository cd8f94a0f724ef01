#!/usr/bin/env bash
# Prepares, on this machine, what a lease of a lent GPU machine needs carried along
# (that machine has no network and no git), so the first call can build and measure:
#
#   bash tools/lease_prep.sh [--no-wheels] [--probe] [--ab-dir DIR] [REF...]
#
#  - .whl/: the build requirement the GPU image lacks, nvidia-cutlass at pyproject's
#    pin, as a wheel for the image's Python (3.12); tools/gpu_session.sh and
#    tools/ab_builds.sh install it from there. --no-wheels skips the download.
#  - .ab/REF.tar (or DIR/REF.tar): one `git archive` tarball per REF (a branch, tag or
#    commit; the tarball is named after the ref's last path part, so candidate/x gives
#    x.tar), for tools/ab_builds.sh. The name WORK archives the working tree's tracked
#    changes on top of HEAD. The folder is emptied of tarballs first, so it holds
#    exactly these.
#  - .scratch/tma_stream_probe (--probe): tools/tma_stream_probe.cu built with nvcc.
#
# The three folders are ignored by git: name them in the device call's carry (64 MiB in
# all; the cutlass wheel is about 6.5 MiB, a tarball about 3.7 MiB).
set -euo pipefail

usage="usage: tools/lease_prep.sh [--no-wheels] [--probe] [--ab-dir DIR] [REF...]"
wheels=1
probe=0
ab_dir=.ab
refs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-wheels) wheels=0 ;;
    --probe) probe=1 ;;
    --ab-dir)
      [ $# -ge 2 ] || { echo "$usage (--ab-dir needs a folder)" >&2 && exit 2; }
      mkdir -p "$2"
      ab_dir=$(cd "$2" && pwd)
      shift
      ;;
    -h | --help) echo "$usage" && exit 0 ;;
    -*) echo "$usage (unknown option $1)" >&2 && exit 2 ;;
    *) refs+=("$1") ;;
  esac
  shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if [ "$wheels" = 1 ]; then
  pin=$(python3 -c 'import re, sys
text = open("pyproject.toml").read()
match = re.search(r"\"(nvidia-cutlass==[0-9.]+)\"", text)
sys.exit("no nvidia-cutlass pin in pyproject.toml") if match is None else print(match[1])')
  mkdir -p .whl
  # Only-binary for the lent image's CPython 3.12 on x86_64 (the device README's flags).
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$pin"
  echo "wheels: $(cd .whl && echo ./*.whl)"
fi

if [ ${#refs[@]} -gt 0 ]; then
  mkdir -p "$ab_dir"
  rm -f "$ab_dir"/*.tar
  for ref in "${refs[@]}"; do
    if [ "$ref" = WORK ]; then
      # `git stash create` prints nothing on a clean tree: HEAD is the working tree then.
      commit=$(git stash create)
      commit=${commit:-HEAD}
    else
      commit=$(git rev-parse --verify --quiet "$ref^{commit}") || {
        echo "not a commit: $ref" >&2
        exit 2
      }
    fi
    name=${ref##*/}
    [ -e "$ab_dir/$name.tar" ] && {
      echo "two refs give the tarball name $name.tar" >&2
      exit 2
    }
    git archive "$commit" -o "$ab_dir/$name.tar"
    echo "ab: $ab_dir/$name.tar <- $ref ($(git rev-parse --short "$commit"))"
  done
fi

if [ "$probe" = 1 ]; then
  mkdir -p .scratch
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -cudart static \
    -o .scratch/tma_stream_probe tools/tma_stream_probe.cu
  echo "probe: .scratch/tma_stream_probe"
fi
