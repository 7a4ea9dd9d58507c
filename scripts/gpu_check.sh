#!/usr/bin/env bash
# GPU verification on a machine with a CUDA GPU: toolchain check, precompile of the serving set,
# GPU tests, compute-sanitizer on selected tests, the demos (V4 and V4.1), benchmarks. Logs under
# ${OUT:-gpu-logs}.
#   scripts/gpu_check.sh [tests|sanitize|demo|bench|all]...      (default: all)
#   PYTEST_K='expr'  restricts the GPU tests; SANITIZE_TESTS='file::test ...' picks sanitizer targets;
#   BENCHES='step host ...' picks benchmark modules; AGAINST=MODULE runs those that take --against
#   side by side with another implementation of the API.
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
parts=${*:-all}
want() { [[ " $parts " == *" $1 "* || " $parts " == *" all "* ]]; }
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
python3 -m dsv4jit info --check 2>&1 | tee "$out/info.log" || status=1
python3 -m dsv4jit precompile --arch auto -j "${JOBS:-16}" 2>&1 | tee "$out/precompile.log" | tail -3 || status=1

if want tests; then
  python3 -m pytest -q -m gpu --noconftest tests ${PYTEST_K:+-k "$PYTEST_K"} -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if want sanitize; then
  for tool in memcheck racecheck; do
    for t in ${SANITIZE_TESTS:-}; do
      echo "== compute-sanitizer --tool $tool $t" | tee -a "$out/sanitizer.log"
      compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
        python3 -m pytest -q -x --noconftest -p no:cacheprovider "$t" 2>&1 | tail -4 | tee -a "$out/sanitizer.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
  done
fi
if want demo; then
  for model in v4 v4.1; do
    python3 -m dsv4jit demo --model "$model" --no-progress 2>&1 | tee "$out/demo-$model.log" | tail -2
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
if want bench; then
  for b in ${BENCHES:-step compress store low_ratio host plan overhead loader}; do
    against=()
    case $b in step|compress|store|low_ratio|host) [ -n "${AGAINST:-}" ] && against=(--against "$AGAINST") ;; esac
    python3 -m "dsv4jit.bench.$b" "${against[@]}" 2>&1 | tee "$out/bench-$b.log" || status=1
  done
fi
exit $status
