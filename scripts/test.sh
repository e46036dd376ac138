#!/usr/bin/env bash
# Installs everything (scripts/install.sh), then runs every check CI runs: lint, the schema
# drift check, the test suite, and the benchmark smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The dashboard's browser tests drive Debian's chromium through its chromedriver (a matched
# pair); without them those tests skip and say why.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: adding Debian's chromium and chromium-driver (dashboard tests)" >&2
    (apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 \
          && apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1)) \
      || echo "test: chromium unavailable; the dashboard's browser tests will skip" >&2
  fi
fi
export MLX_DISABLE_COMPILE=1  # CPU kernel compilation shells out to g++: +20 s, no gain here
# Some machines (this project's CI among them) set PYTHONDONTWRITEBYTECODE=1: then no .pyc is
# ever written and every process compiles what it imports from source, each xdist worker its
# test modules and every runner mlx-lm and transformers again (1.7 s of CPU a runner start,
# measured; the suite starts hundreds). Bytecode is written once, then read.
unset PYTHONDONTWRITEBYTECODE
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
.venv/bin/ruff check fleet tests bench
.venv/bin/fleet schemas --check
# The suite over pytest-xdist workers (README, "Tests"): most tests wait on processes and the
# bus, so more workers than cores pays (FLEET_TEST_WORKERS). A file's tests run on one worker
# (a module's shared stack is built once; the fault tests run one at a time), the costly
# tiers and the long files first; tests/conftest.py lets only a few process-starting tests
# run at once (FLEET_TEST_HEAVY_SLOTS). (xdist's loadgroup is no use here: xdist 3.8 sets a
# node id that pytest 9 no longer reads.) --durations is CI's table.
started=$SECONDS
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 \
  -n "${FLEET_TEST_WORKERS:-5}" --dist loadfile --no-loadscope-reorder "$@"
echo "test: the suite took $((SECONDS - started)) s (README, Tests: the times to compare with)" >&2
if .venv/bin/fleet bench --help >/dev/null 2>&1; then
  # Bounded twice: the bench limits every wait of its own, and this limit holds even if one
  # is missed (~1 min normally; a hang once cost a whole CI run).
  started=$SECONDS
  timeout --kill-after=30 900 .venv/bin/fleet bench --quick
  echo "test: fleet bench --quick took $((SECONDS - started)) s" >&2
fi
