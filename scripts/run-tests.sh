#!/usr/bin/env bash
# `make test`: the whole suite on both supported configurations.
#
#   postgres  PostgreSQL + Redis (TEST_DATABASE_URL, TEST_REDIS_URL): every test.
#   embedded  SQLite + the embedded Redis, what `make run` uses: every test that touches the
#             database again (tests/testenv.py deselects the rest, which do not depend on it).
#
# In each pass the ledger property test (10,000 lifecycles, minutes of mostly database round
# trips) runs beside the rest, in its own database and Redis, so a pass takes the longer of
# the two, not their sum: the rest spends much of its time waiting on containers, VMs and the
# browser. TEST_BACKENDS picks the passes ("postgres embedded" by default); pytest arguments
# (make test PYTEST_ARGS=...) run as one plain pytest per pass.
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

# run_pass NAME ENV... : one pass, the ledger test beside the rest unless arguments were given.
run_pass() {
  local name=$1
  shift
  local -a env=("$@")
  printf '\n==> tests: %s pass\n' "$name"
  if ((${#ARGS[@]})); then
    env "${env[@]}" "$PY" -m pytest "${ARGS[@]}" || failed+=("$name")
    return
  fi
  local -a ledger_env=("${env[@]}" "GPUSHARE_VAR_DIR=$VAR-$name-ledger")
  if [[ $name == postgres ]]; then
    mapfile -t extra < <(ledger_postgres_env)
    ledger_env+=("${extra[@]}")
  fi
  local log
  log=$(mktemp)
  echo "ledger property test running beside the suite; its output follows the suite's"
  env "${ledger_env[@]}" "$PY" -m pytest -p no:cacheprovider "$LEDGER" >"$log" 2>&1 &
  local ledger_pid=$!
  env "${env[@]}" "$PY" -m pytest --ignore="$LEDGER" || failed+=("$name")
  wait "$ledger_pid" || failed+=("$name ledger")
  printf '\n==> %s (%s pass)\n' "$LEDGER" "$name"
  cat "$log"
  rm -f "$log"
}

ARGS=("$@")
for backend in ${TEST_BACKENDS:-postgres embedded}; do
  case $backend in
    postgres)
      run_pass postgres "DATABASE_URL=$TEST_DATABASE_URL" "REDIS_URL=$TEST_REDIS_URL" "GPUSHARE_VAR_DIR=$VAR"
      ;;
    embedded)
      # env -u: the embedded pass must not see the machine's servers.
      run_pass embedded -u DATABASE_URL -u REDIS_URL "GPUSHARE_TEST_BACKEND=embedded" "GPUSHARE_VAR_DIR=$VAR-embedded"
      ;;
    *) echo "run-tests: unknown backend $backend (postgres, embedded)" >&2; exit 2 ;;
  esac
done
if ((${#failed[@]})); then
  echo "tests failed: ${failed[*]}"
  exit 1
fi
echo "tests passed: ${TEST_BACKENDS:-postgres embedded}"
