#!/usr/bin/env bash
# One GPU session's checks and measurements in one command, for a lent H200 machine
# (torch with CUDA already installed). On two GPUs the test/sanitizer lane (GPU 0) and
# the bench lane (GPU 1) run side by side, then the EP2 checks and bench use both; on
# one GPU the lanes run one after the other and EP2 is skipped.
#
#   bash tools/gpu_session.sh OUT_DIR [quick | weight-bound]
#
# Writes OUT_DIR/summary.txt (one line per stage: exit status, seconds, last log line;
# the command exits 1 if any stage failed)
# and OUT_DIR/logs.tgz (every stage's log, the bench JSON, the sanitizer summaries) and
# nothing else: the device tool returns at most 8 files from $OUT, so the logs are
# written elsewhere and packed into OUT_DIR after each stage.
# "quick" skips racecheck and initcheck (the slow tools). "weight-bound" runs issue 17's
# few-token measurements instead of both lanes: the streaming kernels' GPU tests, the
# forward's and the F+B's kernels in their replayed CUDA graphs at T = 128 and 512
# (MXFP4), and the token sweep (BF16 and MXFP4, eager and replayed) in two stages: 128,
# 512 and 2,048 with its plot, then 8,192 and 65,536; its stages' limits add to 495 s,
# which with the build (54 s on an H100 machine's 16 cores) fits the device tool's 600 s
# a call (docs/PERFORMANCE.md, sixty-seventh session, has the stages' measured times).
# Each stage has a time limit; a full run took about 7 minutes on nvidia-h200-x2 in
# stages (2026-11-29), under the device tool's 10-minute call limit. NVLink multicast
# stays off (NCCL_NVLS_ENABLE=0).
set -u

usage="usage: tools/gpu_session.sh OUT_DIR [quick | weight-bound]"
out=${1:?$usage}
mode=${2:-full}
case "$out" in
  -h | --help) echo "$usage" && exit 0 ;;
  -*) echo "$usage (OUT_DIR may not start with '-', got $out)" >&2 && exit 2 ;;
esac
if [[ "$mode" != full && "$mode" != quick && "$mode" != weight-bound ]]; then
  echo "$usage (got mode $mode)" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd) || exit 2
logs=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)

# OUT_DIR's two files, from what the stages have written so far. Refreshed after every
# stage: a call that the device tool stops at its limit still returns the stages done.
# Written under a name of this process (lanes run as subshells) and renamed into place.
pack() {
  local tmp="$out/.pack.$BASHPID"
  (cd "$logs" && tar czf "$tmp.tgz" ./*.log ./*.json ./*.png sanitizer/*.json 2>/dev/null)
  mv -f "$tmp.tgz" "$out/logs.tgz"
  cp "$logs/summary.txt" "$tmp.txt" && mv -f "$tmp.txt" "$out/summary.txt"
}

stage() { # name, limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - t0))s :: $(tail -1 "$logs/$name.log" | cut -c1-150)" >>"$logs/summary.txt"
  pack
}

# The lent machines have no network: the build requirements the image lacks (the pinned
# nvidia-cutlass headers, nox) come as wheels carried along in .whl/ (or MEGAMOE_WHEELS).
wheels=${MEGAMOE_WHEELS:-$root/.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/megamoe-build-site "$wheels"/*.whl \
    >"$logs/pip.log" 2>&1
  export PYTHONPATH=/tmp/megamoe-build-site${PYTHONPATH:+:$PYTHONPATH}
fi
(cd "$root" && CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-build-isolation --no-deps .) \
  >"$logs/build.log" 2>&1 || {
  tail -30 "$logs/build.log"
  cp "$logs/build.log" "$out/"
  exit 1
}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "build done in $(($(date +%s) - start))s; $gpus GPU(s)" >>"$logs/summary.txt"
cd /tmp || exit 1 # import the installed wheel, not the source tree

pytest_cmd=(python3 -m pytest -q --tb=short -p no:cacheprovider)
config=(--rootdir="$root" -c "$root/pyproject.toml")
sanitize=(python3 -m megamoe.testing.sanitizer --out "$logs/sanitizer")

test_lane() {
  export CUDA_VISIBLE_DEVICES=0
  stage gpu_tests 240 "${pytest_cmd[@]}" "$root/tests/gpu"
  stage planted 60 "${pytest_cmd[@]}" "${config[@]}" "$root/tests/sanitizer/test_planted_errors.py"
  local tools=(memcheck synccheck)
  [ "$mode" = quick ] || tools+=(initcheck racecheck)
  for tool in "${tools[@]}"; do
    # racecheck over the whole suite ran past 160 s on an H100 (2026-12-05); the others
    # took 26-50 s there.
    local limit=150
    [ "$tool" = racecheck ] && limit=260
    stage "san_$tool" "$limit" "${sanitize[@]}" --tool "$tool" --timeout $((limit - 10)) -- "${config[@]}" "$root/tests/sanitizer"
  done
}

bench_lane() {
  export CUDA_VISIBLE_DEVICES=$1
  local bench=(python3 -m megamoe.bench --quiet --shape ep4rank)
  stage bench_side 90 "${bench[@]}" --backend fused,baseline --json "$logs/bench_side.json"
  # MXFP4: every GEMM decodes the codes inside its pipeline (there is no other mode).
  stage bench_mxfp4 60 "${bench[@]}" --dtype mxfp4 --backend fused --json "$logs/bench_mxfp4.json"
  stage bench_ordinary 90 "${bench[@]}" --mode ordinary --backend fused,baseline --json "$logs/bench_ordinary.json"
  stage breakdown 60 python3 -m megamoe.bench.breakdown --pass fwd+bwd
  stage breakdown_ordinary 60 python3 -m megamoe.bench.breakdown --pass fwd+bwd --mode ordinary
  stage memory 60 python3 -m megamoe.bench.memory --shape ep4rank
  stage engine 60 python3 -m megamoe.bench.engine --json "$logs/engine.json"
}

# Issue 17's regime: few tokens per rank, where the weights' read sets the time.
weight_bound_lane() {
  export CUDA_VISIBLE_DEVICES=0
  stage stream_tests 45 "${pytest_cmd[@]}" "$root/tests/gpu/test_weight_stream.py"
  local breakdown=(python3 -m megamoe.bench.breakdown --cuda-graph --dtype mxfp4 --iters 10)
  local tokens
  for tokens in 128 512; do
    stage "graph_forward_t$tokens" 35 "${breakdown[@]}" --pass forward --tokens "$tokens"
    stage "graph_fwd_bwd_t$tokens" 35 "${breakdown[@]}" --pass fwd+bwd --tokens "$tokens"
  done
  # The sweep prints its table and draws its plot only at its end (its JSON after every
  # configuration): two stages, each with room. The plot (issue 17's regime) needs
  # matplotlib; without it the JSON and the table still come back.
  local plot=()
  python3 -c 'import matplotlib' 2>/dev/null && plot=(--plot "$logs/token_sweep_few.png")
  local sweep=(python3 -m megamoe.bench --quiet --dtype "bf16,mxfp4" --cuda-graph)
  stage token_sweep_few 130 "${sweep[@]}" --tokens 128,512,2048 \
    --json "$logs/token_sweep_few.json" "${plot[@]}"
  stage token_sweep_many 180 "${sweep[@]}" --tokens 8192,65536 \
    --json "$logs/token_sweep_many.json"
}

if [ "$mode" = weight-bound ]; then
  weight_bound_lane
elif [ "$gpus" -ge 2 ]; then
  test_lane &
  bench_lane 1 &
  wait
  stage ep_checks 120 python3 -m torch.distributed.run --nproc-per-node 2 "$root/tests/gpu/ep_nccl_worker.py"
  stage ep_bench 120 python3 -m megamoe.bench --ep 2 --json "$logs/ep2.json"
else
  test_lane
  bench_lane 0
fi
echo "end after $(($(date +%s) - start))s" >>"$logs/summary.txt"

pack
cd "$logs" || exit 1
cat summary.txt
# A failed stage fails the command (the summary says which): rc 0 only if all passed.
if grep -Eq ' rc=[1-9]' summary.txt; then
  exit 1
fi
