#!/usr/bin/env bash
# The prebuilt kernels on a GPU machine with no compiler in reach and no network: a fresh venv that
# takes torch from the image (a .pth file naming the running python3's packages), the dsv4jit wheel, a
# wheel of prebuilt kernels and tvm-ffi installed from local files (--no-index --no-deps), nvcc hidden,
# DSV4JIT_NO_COMPILE=1 and an empty kernel cache; then `info`, the serving set listed and every variant
# of it loaded, the demo and examples/serving_step.py, and a check that nothing was compiled. Logs
# under ${OUT:-prebuilt-logs}.
#
#   scripts/prebuilt_check.sh WHEELS_DIR TVM_FFI_DIR
#     WHEELS_DIR   dsv4jit-<version>-py3-none-any.whl (python -m build) and
#                  dsv4jit_kernels-*.whl (python -m dsv4jit package --arch 9.0a)
#     TVM_FFI_DIR  an apache_tvm_ffi wheel for this machine's Python
set -uo pipefail
[ $# -eq 2 ] || { sed -n '2,11p' "$0"; exit 2; }
wheels=$(cd "$1" && pwd) || exit 2
tvm_ffi=$(cd "$2" && pwd) || exit 2
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-prebuilt-logs}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
status=0
step() {  # step NAME COMMAND...: run it, its output in $out/NAME.log, its status in the summary
  local name=$1; shift
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc" | tee -a "$out/summary.txt"
  [ $rc = 0 ] || status=1
  tail -3 "$out/$name.log"
}

: >"$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$out/summary.txt"
ls -l "$wheels" "$tvm_ffi" | tee -a "$out/summary.txt"

python3 -m venv "$work/venv"
python=$work/venv/bin/python
# The venv sees the packages of the python3 running this script (torch and its dependencies from the
# image), also where that python3 is a venv itself, whose packages --system-site-packages would skip.
python3 -c 'import sysconfig; print("\n".join(sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})))' \
  >"$("$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/image-packages.pth"
step install "$python" -m pip install --no-index --no-deps "$tvm_ffi"/apache_tvm_ffi-*.whl \
  "$wheels"/dsv4jit-*.whl "$wheels"/dsv4jit_kernels-*.whl
[ $status = 0 ] || { echo "the wheels did not install: $out/install.log"; exit 1; }

# No compiler: no folder of PATH that holds nvcc, CUDA_HOME naming one without it (dsv4jit's lookup stops
# there, before /usr/local/cuda), no other DSV4JIT_* setting, a kernel cache of our own, outside the clone.
mkdir -p "$work/no-cuda" "$work/run"
PATH=$(printf '%s\n' "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || printf '%s:' "$d"; done)
export PATH=${PATH%:} CUDA_HOME=$work/no-cuda
unset CUDA_PATH $(env | grep -o '^DSV4JIT_[A-Z_]*')
export DSV4JIT_NO_COMPILE=1 DSV4JIT_CACHE_DIR=$work/cache
cd "$work/run"
if command -v nvcc; then echo "nvcc is still on PATH"; exit 1; fi

step info "$python" -m dsv4jit info
grep -q "^nvcc: - " "$out/info.log" || { echo "info: dsv4jit found an nvcc" | tee -a "$out/summary.txt"; status=1; }
grep "^prebuilt kernels: " "$out/info.log" | tee -a "$out/summary.txt"
step list-missing "$python" -m dsv4jit list --status missing
step load-serving-set "$python" - <<'EOF'
import time

from dsv4jit.jit import loader, prebuilt
from dsv4jit.jit.kernels import SPECS
from dsv4jit.jit.toolchain import Arch, resolve_arch
from dsv4jit.runtime import serving_variants

root = prebuilt.installed().root
for spec in SPECS.values():
    for variant in serving_variants(spec):
        arch = Arch.host() if spec.target == "host" else resolve_arch()
        start = time.perf_counter()
        loader.load(variant, arch)
        entry = loader.resolve(variant, arch).entry
        assert entry.is_relative_to(root), (variant.id, entry)
        print(f"{variant.id} {arch}: loaded in {1e3 * (time.perf_counter() - start):.1f} ms from {entry}")
EOF
step demo "$python" -m dsv4jit demo --no-progress
step serving-step "$python" "$repo/examples/serving_step.py"

compiled=$(find "$work/cache" -name module.so 2>/dev/null | wc -l)
echo "modules compiled into the empty cache: $compiled" | tee -a "$out/summary.txt"
[ "$compiled" = 0 ] || status=1
rm -rf "$work"
echo "prebuilt check: $([ $status = 0 ] && echo passed || echo FAILED)" | tee -a "$out/summary.txt"
exit $status
