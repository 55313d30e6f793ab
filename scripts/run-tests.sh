#!/usr/bin/env bash
# `make test`: the whole suite. On PostgreSQL the ledger property test (10,000 lifecycles,
# about ten minutes of mostly database round trips) runs beside the rest, in its own test
# database and Redis database, so the suite takes the longer of the two, not their sum:
# the rest spends much of its time waiting on containers, VMs and the browser.
# With arguments (PYTEST_ARGS) or on SQLite, one plain pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LEDGER=tests/portal/test_ledger_properties.py

if [[ $# -gt 0 || "${DATABASE_URL:-}" != postgres* || -n "${TESTS_SERIAL:-}" ]]; then
  exec "$PY" -m pytest "$@"
fi

# The same server with "_ledger" after the database name; the next Redis database (or, with
# the embedded Redis, its own var directory).
read -r ledger_db ledger_redis < <("$PY" - <<'PY'
import os
from urllib.parse import urlsplit, urlunsplit

db = urlsplit(os.environ["DATABASE_URL"])
print(urlunsplit(db._replace(path=db.path.rstrip("/") + "_ledger")), end=" ")
redis = os.environ.get("REDIS_URL", "")
if redis:
    r = urlsplit(redis)
    index = int(r.path.strip("/") or 0)
    print(urlunsplit(r._replace(path=f"/{index - 1 if index > 1 else index + 1}")))
else:
    print("-")
PY
)
ledger_env=(DATABASE_URL="$ledger_db" GPUSHARE_VAR_DIR="${GPUSHARE_VAR_DIR:-var/test}-ledger")
[[ "$ledger_redis" != "-" ]] && ledger_env+=(REDIS_URL="$ledger_redis")
ledger_log=$(mktemp)
trap 'rm -f "$ledger_log"' EXIT

echo "ledger property test running beside the suite (${ledger_db##*/}); its output follows the suite's"
env "${ledger_env[@]}" "$PY" -m pytest -p no:cacheprovider "$LEDGER" >"$ledger_log" 2>&1 &
ledger_pid=$!
"$PY" -m pytest --ignore="$LEDGER"
suite=$?
wait "$ledger_pid"
ledger=$?
printf '\n==> %s\n' "$LEDGER"
cat "$ledger_log"
((suite == 0 && ledger == 0)) || { echo "tests failed: suite exit $suite, ledger exit $ledger"; exit 1; }
