#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
#   bash tests/run.sh            # everything: lint, types, tests, OTel SDK / Python version matrix
#   MATRIX=0 bash tests/run.sh   # skip the version matrix (quicker local runs)
#   WORKERS=4 bash tests/run.sh  # pytest-xdist workers for the main tests (default 2: one per core here)
#   MATRIX_JOBS=2 bash tests/run.sh  # matrix environments that test at once, beside the main tests (default 3)
#   STALLWATCH_SOAK_SCALE=1 bash tests/run.sh   # with the full soak (the default runs a tenth of it)
# Virtual environments go under $VENVS (default: .venvs/ in the repository; git-ignored). The main one
# installs the versions locked in .ci/constraints.txt (refresh them on purpose: bash .ci/lock).
set -euo pipefail
cd "$(dirname "$0")/.."
VENVS=${VENVS:-$PWD/.venvs}
PYENV_ROOT=${PYENV_ROOT:-$HOME/.pyenv}
WORKERS=${WORKERS:-2}
MATRIX_JOBS=${MATRIX_JOBS:-3}
LOGS=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$LOGS"' EXIT  # jobs: installs and passes still running after a failure
mkdir -p "$VENVS"

log() { printf '\n== %s (%s s)\n' "$*" "$SECONDS"; }

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

# The version matrix: the modules with matrix tests, on other CPython releases and OpenTelemetry SDKs,
# each with the grpc extra and without the test extras. Fork handling changed across SDK releases
# (1.28 WeakMethod, 1.32, 1.34 shared BatchProcessor, 1.40, 1.44 provider hooks): the oldest supported
# SDK runs on the oldest and the newest CPython, the newest SDK (the one locked for the main tests) on
# both too, and two SDKs in between on 3.12 and 3.13. Half of them run with STALLWATCH_FAST_PATHS=false
# (only public SDK objects: sdk_compat), the oldest and the newest SDK each way. Each entry: Python, SDK,
# instrumentation, STALLWATCH_FAST_PATHS.
newest_sdk=$(sed -n 's/^opentelemetry-sdk==//p' .ci/constraints.txt)
newest_instrumentation=$(sed -n 's/^opentelemetry-instrumentation==//p' .ci/constraints.txt)
MATRIX_COMBOS=(
  "3.10 1.27.0 0.48b0 false"
  "3.10 $newest_sdk $newest_instrumentation true"
  "3.12 1.33.1 0.54b1 false"
  "3.13 1.27.0 0.48b0 true"
  "3.13 1.39.1 0.60b1 true"
  "3.13 $newest_sdk $newest_instrumentation false"
)
[ "${MATRIX:-1}" != "0" ] || MATRIX_COMBOS=()
matrix_venv() { set -- $1; echo "py$1-otel$2"; }

log "main environment: Python 3.11, .ci/constraints.txt"
make_venv main "$(python_for 3.11)" -c .ci/constraints.txt -e '.[test]'
MAIN="$VENVS/main/bin"

# The matrix environments install in the background while the main tests run.
log "matrix environments: ${#MATRIX_COMBOS[@]}, installing in the background"
installs=()
for combo in "${MATRIX_COMBOS[@]}"; do
  set -- $combo
  name=$(matrix_venv "$combo")
  # opentelemetry-instrumentation 0.48b0 imports pkg_resources without requiring setuptools, which
  # environments of CPython 3.12+ do not get by default: one that has it for 3.12+ (66.1) and does
  # not yet warn on the host's stderr that it is deprecated (67.5).
  old_instrumentation=()
  [ "$3" != 0.48b0 ] || old_instrumentation=("setuptools>=66.1,<67.5")
  make_venv "$name" "$(python_for "$1")" -e '.[grpc]' pytest uvloop sentry-sdk opentelemetry-exporter-prometheus \
    "opentelemetry-api==$2" "opentelemetry-sdk==$2" "opentelemetry-exporter-otlp-proto-http==$2" \
    "opentelemetry-exporter-otlp-proto-grpc==$2" "opentelemetry-instrumentation==$3" "${old_instrumentation[@]}" \
    >"$LOGS/venv-$name" 2>&1 &
  installs+=("$!:$name")
done

# Every test pass runs, even after one failed: a run reports all its failures. Exit status 5 is a pass
# that selected no test.
failed=()
passed() { [ "$1" = 0 ] || [ "$1" = 5 ]; }
result() {  # result STATUS NAME: say how a pass ended, note a failure as NAME
  if passed "$1"; then echo "-- $2: passed"; else echo "-- $2: FAILED (exit status $1)"; failed+=("$2"); fi
}
report() {  # report PID LOG NAME: wait for a background pass, print its log and its result
  local status=0
  wait "$1" || status=$?
  log "$3: done"
  cat "$2"
  result "$status" "$3"
}

# The parallel pass: lint and types, the main tests on $WORKERS workers and the matrix environments
# ($MATRIX_JOBS at a time), all at once. None of these tests asserts a time bound (those are marked
# serial and run afterwards, alone) and most of them wait on children, so side by side they use the
# cores that one of them alone leaves idle. Each writes its own log, printed when it ends.
log "in parallel: ruff and mypy; pytest: Python 3.11, locked dependencies, $WORKERS workers; the matrix once installed"
{
  status=0
  echo "-- ruff"
  "$MAIN/ruff" check src tests dashboards || status=1
  "$MAIN/ruff" format --check src tests dashboards || status=1
  echo "-- mypy (configured in pyproject.toml)"
  "$MAIN/mypy" || status=1
  exit "$status"
} >"$LOGS/lint" 2>&1 &
lint=$!
"$MAIN/python" -m pytest -q -n "$WORKERS" --dist loadgroup -m "not serial" >"$LOGS/main" 2>&1 &
main=$!

if [ ${#MATRIX_COMBOS[@]} -gt 0 ]; then
  for entry in "${installs[@]}"; do
    if ! wait "${entry%%:*}"; then
      cat "$LOGS/venv-${entry#*:}"
      echo "installing the ${entry#*:} environment failed" >&2
      exit 1
    fi
  done
  log "matrix environments installed"
  # Only the modules with matrix tests are collected: the others import test-only packages
  # (dstack, nebius, hypothesis) that these environments do not install.
  modules=$(grep -l "mark.matrix" tests/test_*.py)
  run_matrix() {  # run_matrix COMBO MARKS
    set -- $1 "$2"
    STALLWATCH_FAST_PATHS=$4 "$VENVS/$(matrix_venv "$1 $2")/bin/python" -m pytest -q -p no:cacheprovider -m "$5" \
      $modules
  }
  run_lane() {  # run_lane COMBO...: the environments' matrix tests but the serial ones, one environment after another
    local combo status
    for combo in "$@"; do
      status=0
      run_matrix "$combo" "matrix and not serial" >"$LOGS/matrix-$(matrix_venv "$combo")" 2>&1 || status=$?
      echo "$status" >"$LOGS/status-$(matrix_venv "$combo")"
    done
  }
  lanes=()
  for ((lane = 0; lane < MATRIX_JOBS && lane < ${#MATRIX_COMBOS[@]}; lane++)); do
    combos=()
    for ((i = lane; i < ${#MATRIX_COMBOS[@]}; i += MATRIX_JOBS)); do combos+=("${MATRIX_COMBOS[i]}"); done
    run_lane "${combos[@]}" &
    lanes+=("$!")
  done
fi

report "$lint" "$LOGS/lint" "ruff and mypy"
report "$main" "$LOGS/main" "main"
if [ ${#MATRIX_COMBOS[@]} -gt 0 ]; then
  for lane in "${lanes[@]}"; do wait "$lane" || true; done  # each environment's status is in its own file
  log "matrix: ${#MATRIX_COMBOS[@]} environments, $MATRIX_JOBS at a time (STALLWATCH_FAST_PATHS=false in:$(
    for combo in "${MATRIX_COMBOS[@]}"; do set -- $combo; [ "$4" = true ] || printf ' %s/%s' "$1" "$2"; done)): done"
  for combo in "${MATRIX_COMBOS[@]}"; do
    set -- $combo
    printf -- '-- Python %s, opentelemetry-sdk %s, STALLWATCH_FAST_PATHS=%s\n' "$1" "$2" "$4"
    cat "$LOGS/matrix-$(matrix_venv "$combo")" || true
    result "$(cat "$LOGS/status-$(matrix_venv "$combo")" || echo "none: its lane ended first")" \
      "matrix: Python $1 / SDK $2 / fast paths $4"
  done
fi

# The serial pass: each test alone on the machine, the main environment's then each matrix environment's.
log "pytest: the tests marked serial, alone"
status=0
"$MAIN/python" -m pytest -q -m serial || status=$?
result "$status" "main (serial)"
if [ ${#MATRIX_COMBOS[@]} -gt 0 ]; then
  log "matrix: the tests marked serial, one environment at a time"
  for combo in "${MATRIX_COMBOS[@]}"; do
    set -- $combo
    printf -- '-- Python %s, opentelemetry-sdk %s, STALLWATCH_FAST_PATHS=%s\n' "$1" "$2" "$4"
    status=0
    run_matrix "$combo" "matrix and serial" || status=$?
    result "$status" "matrix: Python $1 / SDK $2 / fast paths $4 (serial)"
  done
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  log "some tests failed"
  exit 1
fi
log "all tests passed"
