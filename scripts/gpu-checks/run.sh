#!/usr/bin/env bash
# gpushare's device checks for a lent H100/H200: about 2 minutes on an H200, as root, from the repo root:
#     OUT=<dir> bash scripts/gpu-checks/run.sh          (add GPUSHARE_CHECK_XID=1 for step 06)
# Read-only as to the GPU's modes: never a MIG, compute-mode, clock, power or persistence
# change, never a reset. It builds a small CUDA client, starts private MPS daemons (quit at
# the end) and runs the project's `gpu` tests. Each step is bounded and writes $OUT/NN_*.txt.
# A lent machine has the driver, CUDA, nvidia-ml-py and pytest but not the platform's other
# packages, and no index to fetch them from: the gpu tests also import redis (wire.config) and
# pyseccomp (the process driver). WHEELS=<dir> installs wheels brought along (made where an index
# is reachable: pip download --no-deps --only-binary=:all: "redis>=5.2,<8" "pyseccomp>=0.1.2,<0.2")
# into a private folder; BWRAP_DEB=<file> unpacks bubblewrap where the machine has none.
set -u
OUT=${OUT:-/tmp/gpu-checks}; mkdir -p "$OUT"; cd "$(dirname "$0")/../.."
SITE=/tmp/gpushare-check-site
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl
fi
if ! command -v bwrap >/dev/null && [ -n "${BWRAP_DEB:-}" ]; then dpkg -x "$BWRAP_DEB" /; fi
export PYTHONPATH=$PWD:$SITE GPUSHARE_CHECK_CLIENT=/usr/local/bin/gpushare-check-client
PY=${PYTHON:-python3}
T() { timeout "$1" "${@:2}"; }

{ echo "PID 1: $(cat /proc/1/comm)"; systemctl --version 2>/dev/null | head -1; uname -r
  nvidia-smi --query-gpu=name,uuid,driver_version,mig.mode.current,compute_mode,persistence_mode --format=csv
  nvidia-smi -q | grep -iE 'Fabric|State|Status|Remapp|Pending' | head -20
  for b in docker nvidia-container-runtime-hook nvidia-ctk nvidia-cuda-mps-control nvidia-modprobe bwrap nvcc; do
    printf '%s: %s\n' "$b" "$(command -v "$b" || echo MISSING)"; done
  grep -E '^\s*mode' /etc/nvidia-container-runtime/config.toml 2>&1
  ls /etc/cdi /var/run/cdi 2>&1; echo "/dev/char nvidia links: $(ls -l /dev/char 2>/dev/null | grep -c nvidia)"
  nvidia-modprobe --help 2>&1 | grep -iE 'capab|-f,' ; ls -l /dev/nvidia* 2>&1 | head -20
  ls /proc/driver/nvidia/gpus 2>&1
} > "$OUT/01_host.txt" 2>&1

nvcc -O2 -o "$GPUSHARE_CHECK_CLIENT" scripts/gpu-checks/client.cu > "$OUT/00_build.txt" 2>&1 && chmod 0755 "$GPUSHARE_CHECK_CLIENT"
T 90 $PY scripts/gpu-checks/checks.py unit > "$OUT/02_unit.txt" 2>&1
T 120 $PY scripts/gpu-checks/checks.py nvml > "$OUT/03_nvml.txt" 2>&1
T 180 $PY scripts/gpu-checks/checks.py mps > "$OUT/04_mps.txt" 2>&1
T 240 $PY scripts/gpu-checks/checks.py tests > "$OUT/05_gpu_tests.txt" 2>&1
if [ "${GPUSHARE_CHECK_XID:-0}" = 1 ]; then T 120 $PY scripts/gpu-checks/checks.py fault > "$OUT/06_fault.txt" 2>&1; fi
tail -n 4 "$OUT"/0*.txt
