#!/usr/bin/env bash
# `elastic local up` / `elastic local down` N times in a row in one shell, as a user does it: after each `up`
# the shell evaluates `elastic local env` and keeps those exports into the next `up` (the case that once
# failed: a shell still pointing at the previous stack). Counts failures (an `up` that exits non-zero, or a
# stack without every planned node) and prints the median and max time of `up` and `down`, as JSON.
#
#   bench/local_up_down.sh              # 30 times, the default stack (head, 1 on-demand, 3 spot nodes)
#   RUNS=5 UP_ARGS="--spot 1 --on-demand 0" bench/local_up_down.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-30}
UP_ARGS=${UP_ARGS:-}
export ELASTIC_HOME=${ELASTIC_HOME:-$(mktemp -d /tmp/elastic-bench-updown-XXXX)}
WORK=$(mktemp -d /tmp/elastic-updown-XXXX)
elastic() { "$PY" -m elastic "$@"; }
trap 'elastic local down >/dev/null 2>&1' EXIT
failures=0
for i in $(seq 1 "$RUNS"); do
  t0=$EPOCHREALTIME
  # shellcheck disable=SC2086
  if elastic local up $UP_ARGS --json >"$WORK/up-$i.json" 2>"$WORK/up-$i.err"; then
    t1=$EPOCHREALTIME
    eval "$(elastic local env)"
    t2=$EPOCHREALTIME
    elastic local down >/dev/null 2>&1
    echo "$i $t0 $t1 $t2 $EPOCHREALTIME" >>"$WORK/times"
  else
    failures=$((failures + 1))
    echo "$i failed $(tail -1 "$WORK/up-$i.err")" >&2
    elastic local down >/dev/null 2>&1
  fi
done
"$PY" - "$WORK" "$RUNS" "$failures" <<'PY'
import json, statistics, sys
from pathlib import Path

work, runs, failures = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rows = [line.split() for line in (work / "times").read_text().splitlines()] if (work / "times").exists() else []
ups = [float(r[2]) - float(r[1]) for r in rows]
downs = [float(r[4]) - float(r[3]) for r in rows]
nodes = [len(json.loads((work / f"up-{r[0]}.json").read_text())["nodes"]) for r in rows]
print(json.dumps({
    "runs": runs,
    "failures": failures,
    "nodes_per_stack": sorted(set(nodes)),
    "up_median_s": round(statistics.median(ups), 1) if ups else None,
    "up_max_s": round(max(ups), 1) if ups else None,
    "down_median_s": round(statistics.median(downs), 1) if downs else None,
    "down_max_s": round(max(downs), 1) if downs else None,
}, indent=2))
PY
