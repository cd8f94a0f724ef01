#!/usr/bin/env bash
# An A/B of package builds in one lease of a lent GPU machine: builds every source
# tarball in AB_DIR side by side, each into its own site folder, then runs COMMAND under
# each build in turn for ROUNDS rounds, alternating builds so that clock and power drift
# fall on all of them alike. Each run has a time limit of LIMIT seconds; a failing or
# timed-out run is logged and the rest go on.
#
# Make the tarballs on this machine, one per build (the lent machine has no git), with
# `bash tools/lease_prep.sh main candidate/NAME WORK` (it also fetches .whl/), or by hand:
#   mkdir -p .ab && git archive main -o .ab/main.tar
#   git archive "$(git stash create)" -o .ab/work.tar   # the working tree's changes
# (`git stash create` prints nothing on a clean tree: archive HEAD then.) .ab/ is ignored
# by git, so name it in the device call's carry, beside .whl/. Then, there:
#   bash tools/ab_builds.sh .ab OUT_DIR 2 60 -- python tools/weight_stream_ab.py --tokens 128
#
# COMMAND runs in /tmp (the build, not the source tree, is imported) with the build's
# site first on PYTHONPATH, AB_NAME set to the tarball's name and AB_ROOT to the
# unpacked tree (for its tests and tools: `pytest "$AB_ROOT/tests/gpu/..."`). Writes
# OUT_DIR/summary.txt (a line per build and run: exit status, seconds, last log line)
# and OUT_DIR/logs.tgz (every log), nothing else: the device tool returns at most 8
# files. The build requirements come from wheels in .whl/ (or MEGAMOE_WHEELS), as in
# tools/gpu_session.sh. Rounds alternate the order of the builds (A B, then B A, ...).
#
# AB_SHARE_BUILD=1: for changes to the Python package only (host-path A/Bs). Only the
# first tarball is built; every other runs its own python/megamoe with that build's
# compiled module (_C and _build_info.py copied in), so the native code is the same
# bits and the lease pays one build.
set -u

usage="usage: tools/ab_builds.sh AB_DIR OUT_DIR ROUNDS LIMIT -- COMMAND..."
[ $# -ge 6 ] && [ "$5" = "--" ] || {
  echo "$usage" >&2
  exit 2
}
ab_dir=$(cd "$1" && pwd) || exit 2
out=$2
rounds=$3
limit=$4
shift 5
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
logs=$(mktemp -d)
work=$(mktemp -d)
trap 'rm -rf "$logs" "$work"' EXIT

mapfile -t tarballs < <(find "$ab_dir" -maxdepth 1 -name '*.tar' | sort)
[ ${#tarballs[@]} -ge 1 ] || {
  echo "no *.tar in $ab_dir" >&2
  exit 2
}

wheels=${MEGAMOE_WHEELS:-$root/.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$work/build-site" "$wheels"/*.whl \
    >"$logs/pip.log" 2>&1
  export PYTHONPATH=$work/build-site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$work/build-site/bin:$PATH
fi
base_path=${PYTHONPATH:-}

names=()
for tarball in "${tarballs[@]}"; do
  name=$(basename "$tarball" .tar)
  names+=("$name")
  mkdir -p "$work/src-$name"
  tar -xf "$tarball" -C "$work/src-$name"
done
built=("${names[@]}")
[ "${AB_SHARE_BUILD:-0}" = 1 ] && built=("${names[0]}")

# Builds side by side, the cores shared among them.
jobs=$(($(nproc) / ${#built[@]}))
[ "$jobs" -ge 1 ] || jobs=1
for name in "${built[@]}"; do
  (
    cd "$work/src-$name" || exit 1
    t0=$(date +%s)
    CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip install -q --no-build-isolation --no-deps \
      --target "$work/site-$name" . >"$logs/build-$name.log" 2>&1
    echo "build $name rc=$? $(($(date +%s) - t0))s" >>"$logs/summary.txt"
  ) &
done
wait
if [ "${AB_SHARE_BUILD:-0}" = 1 ] && [ -d "$work/site-${names[0]}/megamoe" ]; then
  for name in "${names[@]:1}"; do
    mkdir -p "$work/site-$name"
    cp -r "$work/src-$name/python/megamoe" "$work/site-$name/"
    cp "$work/site-${names[0]}"/megamoe/_C*.so "$work/site-${names[0]}/megamoe/_build_info.py" \
      "$work/site-$name/megamoe/"
    echo "python-only $name: ${names[0]}'s compiled module" >>"$logs/summary.txt"
  done
fi

cd /tmp || exit 1
for round in $(seq 1 "$rounds"); do
  order=("${names[@]}")
  if [ $((round % 2)) = 0 ]; then # reversed on even rounds
    order=()
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do order+=("${names[i]}"); done
  fi
  for name in "${order[@]}"; do
    [ -d "$work/site-$name" ] || continue
    log="$logs/$name-$round.log"
    t0=$(date +%s)
    AB_NAME=$name AB_ROOT=$work/src-$name PYTHONPATH=$work/site-$name${base_path:+:$base_path} \
      timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    echo "$name round $round rc=$rc $(($(date +%s) - t0))s :: $(tail -1 "$log" | cut -c1-150)" \
      >>"$logs/summary.txt"
    # Packed after every run: a call cut short still returns what ran.
    tar czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
    cp "$logs/summary.txt" "$out/summary.txt"
  done
done
tar czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
cp "$logs/summary.txt" "$out/summary.txt"
cat "$out/summary.txt"
