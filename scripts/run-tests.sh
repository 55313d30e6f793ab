#!/usr/bin/env bash
# `make test`: the whole suite on both supported configurations.
#
#   postgres  PostgreSQL + Redis (TEST_DATABASE_URL, TEST_REDIS_URL): every test.
#   embedded  SQLite + the embedded Redis, what `make run` uses: every test that touches the
#             database again (tests/testenv.py deselects the rest, which do not depend on it).
#
# Each pass's ledger property test (10,000 lifecycles, minutes of mostly database round
# trips) runs in its own database and Redis, beside the suites (see "What runs beside what" below).
# TEST_BACKENDS picks the passes ("postgres embedded" by default); pytest arguments
# (make test PYTEST_ARGS=...) run as one plain pytest per pass, without the ledger runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LEDGER=tests/portal/billing/test_ledger_properties.py
VAR="${GPUSHARE_VAR_DIR:-var/test}"
export TEST_DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/gpushare}"
export TEST_REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
failed=()

# side_postgres_env SUFFIX OFFSET: the same server with SUFFIX after the database name, and
# the Redis database OFFSET below (or above) the suite's: a background run's own.
side_postgres_env() {
  SUFFIX=$1 OFFSET=$2 "$PY" - <<'PY'
import os
from urllib.parse import urlsplit, urlunsplit

db = urlsplit(os.environ["TEST_DATABASE_URL"])
r = urlsplit(os.environ["TEST_REDIS_URL"])
index, offset = int(r.path.strip("/") or 0), int(os.environ["OFFSET"])
print("DATABASE_URL=" + urlunsplit(db._replace(path=db.path.rstrip("/") + os.environ["SUFFIX"])))
print("REDIS_URL=" + urlunsplit(r._replace(path=f"/{index - offset if index > offset else index + offset}")))
PY
}

# What runs beside what. The foreground is one core of work plus waits on containers, VMs
# and the browser, and it sets the run's length: each pass's tests that start processes,
# engines or the browser, race threads for rows, or touch no database (GPUSHARE_TEST_PART=
# foreground, tests/testenv.py). The rest runs from the start in the background, niced onto
# the core the foreground leaves idle, as two chains: the PostgreSQL ledger test; each pass's
# other database tests (GPUSHARE_TEST_PART=background; PostgreSQL's in its own database and
# Redis), then the embedded ledger test. At equal priority the ledger's steady CPU load
# slowed the suite (a 17-minute PostgreSQL suite took 24 beside it) and starved the
# processes whose timing the e2e tests watch; the race tests starve even niced (SQLite's
# lock wait runs out), so they stay in the foreground. A background failure fails
# `make test`; its output follows the foreground's.
declare -a bg_order=() bg_pids=()
declare -A bg_log bg_rc

# When the script ends, however it ends (a failure, Ctrl-C, kill), nothing it started stays:
# the background chains and their pytests with what they started, then each embedded pass's
# Redis (each pytest stops the one it started as it exits, tests/testenv.py; a killed one
# cannot). The TERM and INT traps run once the foreground pytest has returned (bash waits for
# it): Ctrl-C, or TERM to the process group, stops that one.
tree() {  # tree PID: PID and the processes under it, parents first
  local child
  echo "$1"
  for child in $(pgrep -P "$1"); do tree "$child"; done
}
cleanup() {
  local pid name
  local -a pids=()
  for pid in "${bg_pids[@]}"; do mapfile -t -O "${#pids[@]}" pids < <(tree "$pid"); done
  if ((${#pids[@]})); then
    kill "${pids[@]}" 2>/dev/null  # a pytest tears down on TERM (tests/testenv.py)
    for _ in {1..60}; do  # up to 30 s
      kill -0 "${pids[@]}" 2>/dev/null || break
      sleep 0.5
    done
    kill -KILL "${pids[@]}" 2>/dev/null
  fi
  "$PY" - "$VAR-embedded" "$VAR-embedded-quiet" "$VAR-embedded-ledger" <<'PY'
import sys
from pathlib import Path

from wire.embedded_redis import stop

for var in sys.argv[1:]:
    stop(Path(var) / "redis")
PY
  for name in "${bg_order[@]}"; do rm -f "${bg_log[$name]}" "${bg_rc[$name]}"; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# background_step NAME NICE ENV... -- PYTEST_ARGS... : one pytest, niced; its output and status kept.
background_step() {
  local name=$1 level=$2
  shift 2
  local -a env=()
  while [[ $1 != -- ]]; do env+=("$1"); shift; done
  shift
  env "${env[@]}" nice -n "$level" "$PY" -m pytest -p no:cacheprovider "$@" >"${bg_log[$name]}" 2>&1
  echo $? >"${bg_rc[$name]}"
}

# background NAME... : register each step's log and status before its chain starts.
background() {
  local name
  for name in "$@"; do
    bg_order+=("$name")
    bg_log[$name]=$(mktemp)
    bg_rc[$name]=$(mktemp)
  done
}

# run_pass NAME ENV... -- PYTEST_ARGS... : one foreground pytest.
run_pass() {
  local name=$1
  shift
  local -a env=()
  while [[ $1 != -- ]]; do env+=("$1"); shift; done
  shift
  printf '\n==> tests: %s\n' "$name"
  env "${env[@]}" "$PY" -m pytest "$@" || failed+=("$name")
}

POSTGRES_ENV=("DATABASE_URL=$TEST_DATABASE_URL" "REDIS_URL=$TEST_REDIS_URL")
# env -u: the embedded pass must not see the machine's servers.
EMBEDDED_ENV=(-u DATABASE_URL -u REDIS_URL "GPUSHARE_TEST_BACKEND=embedded")
ARGS=("$@")
BACKENDS=(${TEST_BACKENDS:-postgres embedded})
for backend in "${BACKENDS[@]}"; do
  case $backend in
    postgres | embedded) ;;
    *) echo "run-tests: unknown backend $backend (postgres, embedded)" >&2; exit 2 ;;
  esac
done

if ((${#ARGS[@]})); then  # the arguments as one plain pytest per pass, nothing beside it
  for backend in "${BACKENDS[@]}"; do
    case $backend in
      postgres) run_pass "postgres pass" "${POSTGRES_ENV[@]}" "GPUSHARE_VAR_DIR=$VAR" -- "${ARGS[@]}" ;;
      embedded) run_pass "embedded pass" "${EMBEDDED_ENV[@]}" "GPUSHARE_VAR_DIR=$VAR-embedded" -- "${ARGS[@]}" ;;
    esac
  done
else
  for backend in "${BACKENDS[@]}"; do
    case $backend in
      postgres)
        mapfile -t ledger_db < <(side_postgres_env _ledger 1)
        background "postgres ledger"
        background_step "postgres ledger" 10 "${POSTGRES_ENV[@]}" "${ledger_db[@]}" \
          "GPUSHARE_VAR_DIR=$VAR-postgres-ledger" -- "$LEDGER" &
        bg_pids+=($!)
        mapfile -t quiet_db < <(side_postgres_env _quiet 2)
        background "postgres, no processes"
        ;;
      embedded) background "embedded, no processes" "embedded ledger" ;;
    esac
  done
  (
    for backend in "${BACKENDS[@]}"; do
      case $backend in
        postgres)
          background_step "postgres, no processes" 5 "${POSTGRES_ENV[@]}" "${quiet_db[@]}" \
            "GPUSHARE_VAR_DIR=$VAR-postgres-quiet" GPUSHARE_TEST_PART=background -- --ignore="$LEDGER"
          ;;
        embedded)
          background_step "embedded, no processes" 5 "${EMBEDDED_ENV[@]}" "GPUSHARE_VAR_DIR=$VAR-embedded-quiet" \
            GPUSHARE_TEST_PART=background -- --ignore="$LEDGER"
          ;;
      esac
    done
    for backend in "${BACKENDS[@]}"; do
      [[ $backend == embedded ]] || continue
      background_step "embedded ledger" 10 "${EMBEDDED_ENV[@]}" "GPUSHARE_VAR_DIR=$VAR-embedded-ledger" -- "$LEDGER"
    done
  ) &
  bg_pids+=($!)
  echo "running in the background, niced (output after the foreground's): ${bg_order[*]}"
  for backend in "${BACKENDS[@]}"; do
    case $backend in
      postgres)
        run_pass "postgres pass (foreground part)" "${POSTGRES_ENV[@]}" "GPUSHARE_VAR_DIR=$VAR" \
          GPUSHARE_TEST_PART=foreground -- --ignore="$LEDGER"
        ;;
      embedded)
        run_pass "embedded pass (foreground part)" "${EMBEDDED_ENV[@]}" "GPUSHARE_VAR_DIR=$VAR-embedded" \
          GPUSHARE_TEST_PART=foreground -- --ignore="$LEDGER"
        ;;
    esac
  done
  for pid in "${bg_pids[@]}"; do wait "$pid"; done
  for name in "${bg_order[@]}"; do
    printf '\n==> tests: %s (ran in the background)\n' "$name"
    cat "${bg_log[$name]}"
    [[ $(cat "${bg_rc[$name]}") == 0 ]] || failed+=("$name")
    rm -f "${bg_log[$name]}" "${bg_rc[$name]}"
  done
fi
if ((${#failed[@]})); then
  echo "tests failed: ${failed[*]}"
  exit 1
fi
echo "tests passed: ${BACKENDS[*]}"
