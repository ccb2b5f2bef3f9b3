#!/usr/bin/env bash
# The hybrid-parallel examples against DDP on the same BERT-style model,
# steps and density, 4 CPU ranks on loopback: DDP (bert.py, 4 replicas),
# HSDP (hsdp.py, 2 replicas x 2 shards) and pipeline + replicas
# (pipeline.py, 2 stages x 2 replicas), each dense and with oktopk forced
# on the sparse path; then DDP on 2 ranks, for the bytes a DDP hook sends
# over 2 replicas. Writes results/hybrid.md (the RESULT lines, verbatim).
#
#   bench/hybrid.sh PYTHON [STEPS] [DENSITY]
set -euo pipefail
PY=$1
STEPS=${2:-300}
DENSITY=${3:-0.01}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$ROOT/plugins/pytorch OMP_NUM_THREADS=1
out=$ROOT/results/hybrid.md
run() {  # ranks example args...
  local ranks=$1 example=$2
  shift 2
  "$PY" -m torch.distributed.run --nproc-per-node "$ranks" "$ROOT/examples/pytorch/$example" "$@" 2>/dev/null | grep '^RESULT' | sed "s|^RESULT|$example|"
}
{
  echo "# Hybrid parallelism: the examples against DDP"
  echo
  echo "\`bench/hybrid.sh $(basename "$PY") $STEPS $DENSITY\` ($(date -u +%F); 4 ranks on 2 cores, loopback: the milliseconds compare runs"
  echo "with each other, not with a cluster). Adam, the BERT-style model of examples/pytorch/bert.py, $STEPS steps,"
  echo "oktopk forced on the sparse path (\`--algorithm oktopk\`) at density $DENSITY."
  echo
  echo '```'
  for mode in "" "--oktopk --algorithm oktopk --density $DENSITY"; do
    run 4 bert.py --steps "$STEPS" $mode
    run 4 hsdp.py --steps "$STEPS" $mode
    run 4 pipeline.py --steps "$STEPS" $mode
  done
  run 2 bert.py --steps "$STEPS" --oktopk --algorithm oktopk --density "$DENSITY"
  echo '```'
} | tee "$out"
