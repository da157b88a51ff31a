#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
#   bash tests/run.sh            # everything: lint, tests, OTel SDK / Python version matrix
#   MATRIX=0 bash tests/run.sh   # skip the version matrix (quicker local runs)
# Virtual environments go under $VENVS (default: .venvs/ in the repository; git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
VENVS=${VENVS:-$PWD/.venvs}
PYENV_ROOT=${PYENV_ROOT:-$HOME/.pyenv}
mkdir -p "$VENVS"

log() { printf '\n== %s\n' "$*"; }

python_for() {  # python_for 3.12 -> path of a CPython 3.12 interpreter
  local found
  found=$(ls -d "$PYENV_ROOT"/versions/"$1".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$found" ]; then echo "$found"; else command -v "python$1"; fi
}

make_venv() {  # make_venv NAME PYTHON PIP-ARGS...
  local name=$1 python=$2; shift 2
  if [ ! -x "$VENVS/$name/bin/python" ]; then "$python" -m venv "$VENVS/$name"; fi
  "$VENVS/$name/bin/python" -m pip install -q --disable-pip-version-check "$@"
}

# Debian packages the tests run for real: sshd (SSH tunnel tests), prometheus and promtool
# (dashboards and alert rules), chromium (the postmortem's HTML report at 800 and 1400 px). Installed when missing and possible (root with apt-get);
# otherwise those tests skip and say which package to install.
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null || need+=(openssh-client)
command -v promtool >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "apt-get install ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    log "missing ${need[*]} (not root or no apt-get): the tests that need them will skip"
  fi
fi

log "main: Python 3.11, newest dependencies"
make_venv main "$(python_for 3.11)" -e '.[test]'
MAIN="$VENVS/main/bin"
log "ruff"
"$MAIN/ruff" check src tests dashboards
"$MAIN/ruff" format --check src tests dashboards
log "pytest"
"$MAIN/python" -m pytest -q

if [ "${MATRIX:-1}" != "0" ]; then
  # Fork handling changed across SDK releases (1.28 WeakMethod, 1.32, 1.34 shared BatchProcessor,
  # 1.40, 1.44 provider hooks): run the fork tests on older SDKs, each on another CPython.
  for combo in "3.10 1.27.0 0.48b0" "3.12 1.33.1 0.54b1" "3.13 1.39.1 0.60b1"; do
    set -- $combo
    log "matrix: Python $1, opentelemetry-sdk $2"
    make_venv "py$1-otel$2" "$(python_for "$1")" -e . pytest uvloop grpcio sentry-sdk opentelemetry-exporter-prometheus \
      "opentelemetry-api==$2" "opentelemetry-sdk==$2" "opentelemetry-exporter-otlp-proto-http==$2" \
      "opentelemetry-instrumentation==$3"
    # Only the modules with matrix tests are collected: the others import test-only packages
    # (dstack, nebius, hypothesis) that these venvs do not install.
    "$VENVS/py$1-otel$2/bin/python" -m pytest -q -m matrix $(grep -l "mark.matrix" tests/test_*.py)
  done
fi
log "all tests passed"
