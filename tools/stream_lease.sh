#!/usr/bin/env bash
# The weight-streaming kernels' candidates timed in one call on a lent GPU machine:
#  1. the TMA stream probe, where tools/lease_prep.sh --probe built it into .scratch/;
#  2. every tarball in .ab/ built side by side (tools/ab_builds.sh), and under each tree
#     its streaming GPU tests (tests/gpu/test_weight_stream.py, in the first round only)
#     and tools/weight_stream_ab.py (every GEMM at TOKENS, each beside the engine with the
#     outputs' bits compared), ROUNDS rounds alternating the trees' order.
#
#   bash tools/stream_lease.sh OUT_DIR [ROUNDS] [TOKENS]      (defaults: 2, 128,512)
#
# Prepare the carry here with `bash tools/lease_prep.sh --probe main candidate/NAME ...`
# and name .whl, .ab and .scratch in the device call's carry. Writes OUT_DIR/probe.txt,
# OUT_DIR/tests.txt (a line per tree: its test summary) and OUT_DIR/ab/summary.txt and
# logs.tgz: four files, within the device tool's eight.
set -u

usage="usage: tools/stream_lease.sh OUT_DIR [ROUNDS] [TOKENS]"
out=${1:?$usage}
rounds=${2:-2}
tokens=${3:-128,512}
case "$out" in
  -h | --help) echo "$usage" && exit 0 ;;
  -*) echo "$usage (OUT_DIR may not start with '-', got $out)" >&2 && exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd) || exit 2

probe=$root/.scratch/tma_stream_probe
if [ -x "$probe" ]; then
  timeout 120 "$probe" --iters 20 >"$out/probe.txt" 2>&1
  echo "probe rc=$? ($(wc -l <"$out/probe.txt") lines in probe.txt)"
fi

# Per tree (tools/ab_builds.sh sets AB_NAME and AB_ROOT): the tests once, in a marker
# folder of this call's own (a warm machine keeps /tmp between calls), then the A/B.
marks=$(mktemp -d)
trap 'rm -rf "$marks"' EXIT
export STREAM_LEASE_MARKS=$marks STREAM_LEASE_OUT=$out STREAM_LEASE_TOKENS=$tokens
# shellcheck disable=SC2016 # expanded by the inner bash, once per tree
per_tree='
if [ ! -e "$STREAM_LEASE_MARKS/$AB_NAME" ]; then
  touch "$STREAM_LEASE_MARKS/$AB_NAME"
  summary=$(python3 -m pytest -q -p no:cacheprovider -c "$AB_ROOT/pyproject.toml" \
    --rootdir "$AB_ROOT" "$AB_ROOT/tests/gpu/test_weight_stream.py" 2>&1 | tail -1)
  echo "$AB_NAME: $summary" >>"$STREAM_LEASE_OUT/tests.txt"
fi
python3 "$AB_ROOT/tools/weight_stream_ab.py" --tokens "$STREAM_LEASE_TOKENS" --iters 30
'
bash "$root/tools/ab_builds.sh" "$root/.ab" "$out/ab" "$rounds" 240 -- bash -c "$per_tree"
echo "== tests"
cat "$out/tests.txt" 2>/dev/null
