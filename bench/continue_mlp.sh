#!/bin/bash
# The digits MLP trained 200 steps with one rank of four lost at step 50
# under on_rank_loss="continue", against 3 and 4 ranks throughout, seeds
# 0-4 (examples/pytorch/continue.py; results/continue.md):
#
#   bench/continue_mlp.sh OUT [PYTHON]
#
# Each rank is a process of its own over env:// (torchrun's agent would
# stop the survivors); the ranks share the machine's cores.
set -euo pipefail
OUT=${1:?usage: bench/continue_mlp.sh OUT [PYTHON]}
PY=${2:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

run() {  # run P DIR [args...]
  local p=$1 dir=$2; shift 2
  mkdir -p "$dir"
  local port=$((20000 + RANDOM % 20000)) pids=()
  for r in $(seq 0 $((p - 1))); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=$p OMP_NUM_THREADS=1 PYTHONPATH="$ROOT/plugins/pytorch" \
      "$PY" "$ROOT/examples/pytorch/continue.py" --out "$dir" --steps 200 --timeout 10 "$@" > "$dir/r$r.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done  # the lost rank exits by SIGKILL
}

for seed in 0 1 2 3 4; do
  run 4 "$OUT/lost_s$seed" --kill-at 50 --kill-rank 3 --seed "$seed"
  run 3 "$OUT/three_s$seed" --seed "$seed"
  run 4 "$OUT/four_s$seed" --seed "$seed"
done
"$PY" - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
for kind, label in (("lost", "4 ranks, rank 3 lost at step 50"), ("three", "3 ranks throughout"), ("four", "4 ranks throughout")):
    accs = []
    for s in range(5):
        records = [json.load(open(f)) for f in glob.glob(f"{out}/{kind}_s{s}/rank*.json")]
        assert len({r["params"] for r in records}) == 1, f"{kind} seed {s}: the ranks' parameters differ"
        accs.append(records[0]["accuracy"])
    print(f"{label}: " + " / ".join(f"{a:.2f}" for a in accs) + f", mean {statistics.mean(accs):.2f}")
PY
