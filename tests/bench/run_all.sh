#!/usr/bin/env bash
# Regenerates every benchmark summary at the current commit, one benchmark at a time, in the order of
# tests/bench/README.md's table.
#
#   bash tests/bench/run_all.sh                      # all of them, summaries into tests/bench/results
#   bash tests/bench/run_all.sh executor nebius      # only these, in the table's order
#   bash tests/bench/run_all.sh --quick              # smoke: each bench's quick option, into a temp dir
#   bash tests/bench/run_all.sh --list               # the names, their commands and full-run times
#   bash tests/bench/run_all.sh --repo DIR --out DIR NAME...   # another checkout (its benches and venvs)
#
# Refuses to start when the tree has changes other than summaries under tests/bench/results (those a
# stopped run already rewrote, so it can be resumed with the names left). Prints which bench runs and
# the time taken; records `uptime` before each bench in OUT/raw/run_all.log (git-ignored), and each
# bench's output in OUT/raw/run_all-NAME.log; stops at the first bench that fails, showing its output.
# alert_timeline runs alone like the others, although it mostly waits: its Prometheus scrapes and
# evaluates every 15 s and is polled every 2 s, bursts that would land in the p99s of the benches
# beside it and in the machine-wide TCP counters bench_connection_errors reads.
set -euo pipefail
{  # read whole before it runs: a checkout or an edit of this file during a run does not change the run

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=""
quick=0
list=0
names=()
while [ $# -gt 0 ]; do
  case $1 in
    --repo) repo=$(cd "$2" && pwd); shift 2 ;;
    --out) out=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --list) list=1; shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run_all.sh: unknown option $1" >&2; exit 2 ;;
    *) names+=("$1"); shift ;;
  esac
done

# name | venv | arguments | arguments with --quick | full-run time (minutes, on the 2-core machine)
ORDER=(spawn spawn-incident spawn-roundtrip footprint subprocess executor nebius journal watchdog backend_faults
       backend_faults_paired fast_paths scrubbing alert_timeline connection_errors)
declare -A VENV=([spawn]=bench [spawn-incident]=bench [spawn-roundtrip]=bench)
declare -A ARGS=(
  [spawn]="bench_spawn.py"
  [spawn-incident]="bench_spawn.py --load incident"
  [spawn-roundtrip]="bench_spawn.py --load roundtrip"
  [footprint]="bench_footprint.py"
  [subprocess]="bench_subprocess.py"
  [executor]="bench_executor.py"
  [nebius]="bench_nebius.py"
  [journal]="bench_journal.py"
  [watchdog]="bench_watchdog.py"
  [backend_faults]="bench_backend_faults.py"
  [backend_faults_paired]="bench_backend_faults.py --pairs 10"
  [fast_paths]="bench_fast_paths.py"
  [scrubbing]="bench_scrubbing.py"
  [alert_timeline]="alert_timeline.py"
  [connection_errors]="bench_connection_errors.py"
)
declare -A QUICK=(
  [spawn]="bench_spawn.py --quick"
  [spawn-incident]="bench_spawn.py --load incident --quick"
  [spawn-roundtrip]="bench_spawn.py --load roundtrip --quick"
  [footprint]="bench_footprint.py --rounds 1"
  [subprocess]="bench_subprocess.py --quick"
  [executor]="bench_executor.py --quick"
  [nebius]="bench_nebius.py --quick"
  [journal]="bench_journal.py --quick"
  [watchdog]="bench_watchdog.py --quick"
  [backend_faults]="bench_backend_faults.py --quick"
  [backend_faults_paired]="bench_backend_faults.py --quick --pairs 2 --configs refuse-http"
  [fast_paths]="bench_fast_paths.py --quick"
  [scrubbing]="bench_scrubbing.py --repeat 5"
  [alert_timeline]="alert_timeline.py --quick"
  [connection_errors]="bench_connection_errors.py --quick --requests 100"
)
declare -A MINUTES=([spawn]=5 [spawn-incident]=6 [spawn-roundtrip]=2 [footprint]=3 [subprocess]=3 [executor]=6 [nebius]=2
  [journal]=1 [watchdog]=2 [backend_faults]=5 [backend_faults_paired]=22 [fast_paths]=6 [scrubbing]=1
  [alert_timeline]=31 [connection_errors]=16)

command_for() {  # command_for NAME: the command line, run from the repository root
  local name=$1 args
  if [ "$quick" = 1 ]; then args=${QUICK[$name]}; else args=${ARGS[$name]}; fi
  local python=".venvs/${VENV[$name]:-main}/bin/python"
  local nice=""
  [ "$name" = connection_errors ] && nice="nice -n 19 "
  echo "${nice}$python tests/bench/$args --out $out"
}

if [ ${#names[@]} -eq 0 ]; then
  names=("${ORDER[@]}")
else
  for name in "${names[@]}"; do
    [ -n "${ARGS[$name]:-}" ] || { echo "run_all.sh: no bench named $name (--list shows them)" >&2; exit 2; }
  done
  wanted=" ${names[*]} "
  names=()
  for name in "${ORDER[@]}"; do [[ $wanted == *" $name "* ]] && names+=("$name"); done
fi
if [ "$list" = 1 ]; then
  out=${out:-$( [ "$quick" = 1 ] && echo /tmp/bench_all_XXXXXX || echo "$repo/tests/bench/results")}
  total=0
  for name in "${names[@]}"; do
    printf '%-22s %3s min  %s\n' "$name" "${MINUTES[$name]}" "$(command_for "$name")"
    total=$((total + MINUTES[$name]))
  done
  echo "total: about $total min"
  exit 0
fi

if [ -z "$out" ]; then
  if [ "$quick" = 1 ]; then out=$(mktemp -d /tmp/bench_all_XXXXXX); else out=$repo/tests/bench/results; fi
fi
mkdir -p "$out/raw"
out=$(cd "$out" && pwd)

cd "$repo"
dirty=$(git status --porcelain --untracked-files=normal | grep -v '^.. tests/bench/results/[^/]*\.md$' || true)
if [ -n "$dirty" ]; then
  echo "run_all.sh: the tree at $repo has changes; commit them first, so that the summaries name the commit they ran at:" >&2
  echo "$dirty" >&2
  exit 1
fi
for venv in main bench; do
  [ -x ".venvs/$venv/bin/python" ] || { echo "run_all.sh: $repo/.venvs/$venv is missing (tests/bench/README.md)" >&2; exit 1; }
done

log=$out/raw/run_all.log
commit=$(git rev-parse --short HEAD)
expected=0
for name in "${names[@]}"; do expected=$((expected + MINUTES[$name])); done
if [ "$quick" = 1 ]; then expected="quick"; else expected="about $expected min"; fi
echo "== $(date -u +%FT%TZ) commit $commit, ${#names[@]} benches ($expected); out $out" | tee -a "$log"
start=$SECONDS
number=0
for name in "${names[@]}"; do
  number=$((number + 1))
  command=$(command_for "$name")
  bench_log=$out/raw/run_all-$name.log
  printf '%s %-22s start  %s; %s\n' "$(date -u +%FT%TZ)" "$name" "$(uptime)" "$command" >>"$log"
  printf '[%d/%d] %s (%s; %d min so far) ... ' "$number" "${#names[@]}" "$name" "$(date -u +%T)" \
    $(((SECONDS - start) / 60))
  began=$SECONDS
  status=0
  $command >"$bench_log" 2>&1 || status=$?
  took=$((SECONDS - began))
  printf '%s %-22s exit %d after %d s\n' "$(date -u +%FT%TZ)" "$name" "$status" "$took" >>"$log"
  if [ "$status" != 0 ]; then
    echo "FAILED (exit $status after $took s): $command"
    echo "---- last 80 lines of $bench_log"
    tail -n 80 "$bench_log"
    exit "$status"
  fi
  echo "done in $((took / 60)) min $((took % 60)) s"
done
echo "== all ${#names[@]} done in $(((SECONDS - start) / 60)) min; summaries in $out, log $log" | tee -a "$log"
exit
}
