#!/bin/bash
# What on_rank_loss="continue" costs a step with no rank lost: the digits MLP
# of examples/pytorch/continue.py, 4 ranks over env:// on this machine's
# cores, 300 steps, continue and stop alternated in both orders, twice. It
# prints, per run, the median over steps 50-300 of the slowest rank's step
# (results/continue.md):
#
#   bench/continue_overhead.sh OUT [PYTHON]
set -euo pipefail
OUT=${1:?usage: bench/continue_overhead.sh OUT [PYTHON]}
PY=${2:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

run() {  # run MODE DIR
  local mode=$1 dir=$2 port=$((20000 + RANDOM % 20000)) pids=()
  mkdir -p "$dir"
  for r in 0 1 2 3; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=4 OMP_NUM_THREADS=1 PYTHONPATH="$ROOT/plugins/pytorch" \
      "$PY" "$ROOT/examples/pytorch/continue.py" --out "$dir" --steps 300 --timeout 10 --on-rank-loss "$mode" > "$dir/r$r.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}

for rep in 1 2; do
  run continue "$OUT/continue-$rep-a"; run stop "$OUT/stop-$rep-a"
  run stop "$OUT/stop-$rep-b"; run continue "$OUT/continue-$rep-b"
done
"$PY" - "$OUT" <<'PY'
import glob, json, os, statistics, sys
for run in sorted(glob.glob(os.path.join(sys.argv[1], "*"))):
    records = [json.load(open(f)) for f in glob.glob(os.path.join(run, "rank*.json"))]
    slowest = [max(r["step_seconds"][i] for r in records) for i in range(50, 300)]
    print(f"{os.path.basename(run)}: {1000 * statistics.median(slowest):.3f} ms")
PY
