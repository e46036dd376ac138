#!/usr/bin/env bash
# Installs Fleet into .venv at the repo root: idempotent, needs only python3 >= 3.11.
# FLEET_ACCEL=cpu|cuda|metal picks the mlx build (default: metal on macOS, cuda when
# nvidia-smi answers, cpu otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

os=$(uname -s)
accel=${FLEET_ACCEL:-}
if [ -z "$accel" ]; then
  if [ "$os" = Darwin ]; then accel=metal
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then accel=cuda
  else accel=cpu; fi
fi

# Only fp32 matmuls reach BLAS; Debian's OpenBLAS makes mlx's CPU path ~3x faster.
if [ "$os" = Linux ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install: adding Debian's libopenblas0-pthread" >&2
    (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1)) \
      || echo "install: OpenBLAS unavailable; mlx will use its reference BLAS (slower)" >&2
  fi
fi

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "install: Fleet needs Python >= 3.11 (found $(python3 --version))" >&2; exit 2; }
if [ ! -x .venv/bin/python ]; then
  if ! python3 -m venv .venv 2>/dev/null; then
    rm -rf .venv
    # Debian splits venv/ensurepip into its own package.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -q >/dev/null 2>&1 || true
      apt-get install -y -q python3-venv >/dev/null
      python3 -m venv .venv
    else
      echo "install: python3 -m venv failed; install python3-venv (Debian) and rerun" >&2
      exit 2
    fi
  fi
fi
[ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q --disable-pip-version-check 'uv==0.13.9'

case "$accel" in
  cpu) extras="cpu,image,vision,demo,dev" ;;
  cuda) extras="cuda,image,vision,demo,dev" ;;
  metal) extras="image,vision,demo,dev" ;;
  *) echo "install: FLEET_ACCEL must be cpu, cuda or metal" >&2; exit 2 ;;
esac
overrides=ops/overrides-linux.txt
[ "$os" = Darwin ] && overrides=ops/overrides-macos.txt
echo "install: fleet[$extras] into .venv ($accel)" >&2
.venv/bin/uv pip install -q --python .venv/bin/python --override "$overrides" -e ".[$extras]"
.venv/bin/fleet version >&2 || true
