#!/usr/bin/env bash
# `make test`: the whole suite on both supported configurations.
#
#   postgres  PostgreSQL + Redis (TEST_DATABASE_URL, TEST_REDIS_URL): every test.
#   embedded  SQLite + the embedded Redis, what `make run` uses: every test that touches the
#             database again (tests/testenv.py deselects the rest, which do not depend on it).
#
# Each pass's ledger property test (10,000 lifecycles, minutes of mostly database round
# trips) runs in its own database and Redis, beside the suites (see start_ledger).
# TEST_BACKENDS picks the passes ("postgres embedded" by default); pytest arguments
# (make test PYTEST_ARGS=...) run as one plain pytest per pass, without the ledger runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LEDGER=tests/portal/test_ledger_properties.py
VAR="${GPUSHARE_VAR_DIR:-var/test}"
export TEST_DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/gpushare}"
export TEST_REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
failed=()

# The same server with "_ledger" after the database name, and the next Redis database.
ledger_postgres_env() {
  "$PY" - <<'PY'
import os
from urllib.parse import urlsplit, urlunsplit

db = urlsplit(os.environ["TEST_DATABASE_URL"])
r = urlsplit(os.environ["TEST_REDIS_URL"])
index = int(r.path.strip("/") or 0)
print("DATABASE_URL=" + urlunsplit(db._replace(path=db.path.rstrip("/") + "_ledger")))
print("REDIS_URL=" + urlunsplit(r._replace(path=f"/{index - 1 if index > 1 else index + 1}")))
PY
}

# The ledger property tests (one per pass) start first, at low priority (nice), and run
# beside both suites: the suites are mostly one core of work plus waits on containers, VMs
# and the browser, and they set the run's length; at equal priority the ledger's steady
# CPU load slowed them (a 17-minute PostgreSQL suite took 24 beside it) and starved the
# platform processes whose timing the e2e tests watch. Niced, it takes the idle core.
declare -A ledger_pid ledger_log

# start_ledger NAME ENV... : the ledger test of one pass, in the background.
start_ledger() {
  local name=$1
  shift
  local -a env=("$@" "GPUSHARE_VAR_DIR=$VAR-$name-ledger")
  if [[ $name == postgres ]]; then
    mapfile -t extra < <(ledger_postgres_env)
    env+=("${extra[@]}")
  fi
  ledger_log[$name]=$(mktemp)
  env "${env[@]}" nice -n 10 "$PY" -m pytest -p no:cacheprovider "$LEDGER" >"${ledger_log[$name]}" 2>&1 &
  ledger_pid[$name]=$!
  echo "ledger property test ($name) running beside the suites, niced; its output follows them"
}

# run_pass NAME ENV... : one pass of the suite (without the ledger test unless arguments were given).
run_pass() {
  local name=$1
  shift
  printf '\n==> tests: %s pass\n' "$name"
  if ((${#ARGS[@]})); then
    env "$@" "$PY" -m pytest "${ARGS[@]}" || failed+=("$name")
    return
  fi
  env "$@" "$PY" -m pytest --ignore="$LEDGER" || failed+=("$name")
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
if ((${#ARGS[@]} == 0)); then
  for backend in "${BACKENDS[@]}"; do
    case $backend in
      postgres) start_ledger postgres "${POSTGRES_ENV[@]}" ;;
      embedded) start_ledger embedded "${EMBEDDED_ENV[@]}" ;;
    esac
  done
fi
for backend in "${BACKENDS[@]}"; do
  case $backend in
    postgres) run_pass postgres "${POSTGRES_ENV[@]}" "GPUSHARE_VAR_DIR=$VAR" ;;
    embedded) run_pass embedded "${EMBEDDED_ENV[@]}" "GPUSHARE_VAR_DIR=$VAR-embedded" ;;
  esac
done
for backend in "${BACKENDS[@]}"; do
  [[ -n ${ledger_pid[$backend]:-} ]] || continue
  wait "${ledger_pid[$backend]}" || failed+=("$backend ledger")
  printf '\n==> %s (%s pass)\n' "$LEDGER" "$backend"
  cat "${ledger_log[$backend]}"
  rm -f "${ledger_log[$backend]}"
done
if ((${#failed[@]})); then
  echo "tests failed: ${failed[*]}"
  exit 1
fi
echo "tests passed: ${BACKENDS[*]}"
