#!/usr/bin/env bash
# The training-step checks for one lent CUDA GPU (an H200), in one call of about 9 minutes:
#   1. the peer harness: draftline's step beside speculators 0.9.0's at Kimi dims (T 2,048 and
#      4,096, K 3 and 7), from a copy of the shared peer-bench folder inside the checkout;
#   2. benchmarks/train_step.py at Kimi dims, T 4,096, K 7, diagonal attention: the full and
#      the draft-rows teacher, norms and MLPs eager and compiled (train.compile);
#   3. the other draft families at the same size: the MLA draft (with AdamW and with Muon,
#      training's default optimizer: production's step), EAGLE-3.1, P-EAGLE.
# Each part has its own time limit and writes its JSON as it goes, so a part cut short keeps
# what it measured and the next still runs.
#
#   cp -r ../shared/peer-bench/h200-step benchmarks/.peer/h200-step   # git-ignored
#   bash benchmarks/gpu_session.sh OUT            # carry benchmarks/.peer/h200-step
#   PEER= MEMORY_ONLY=1 bash benchmarks/gpu_session.sh OUT   # no GPU: every part's arguments,
#                                                  # checked by printing its analytic memory
set -uo pipefail

OUT=${1:?usage: gpu_session.sh OUT_DIR}
PEER=${PEER-benchmarks/.peer/h200-step}
PEER_S=${PEER_S:-330}    # the harness: about 4-5 minutes plus start-up
STEP_S=${STEP_S:-120}
FAMILY_S=${FAMILY_S:-50}
MEMORY_ONLY=${MEMORY_ONLY:-}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1

if [ -z "$PEER" ]; then
  echo "peer harness: not asked for (PEER empty)" | tee -a "$OUT/summary.txt"
elif [ -f "$PEER/run.sh" ]; then
  # run.sh sizes its phases to its own budget, inside this limit; its cross-check would time
  # train_step.py again, which part 2 does
  DRAFTLINE_ROOT="$PWD" BUDGET_S=$((PEER_S - 10)) CROSSCHECK=0 timeout "$PEER_S" \
    bash "$PEER/run.sh" "$OUT/peer" > "$OUT/peer.log" 2>&1
  echo "peer harness: exit $?" | tee -a "$OUT/summary.txt"
else
  echo "peer harness: $PEER/run.sh not found (copy ../shared/peer-bench/h200-step there)" |
    tee -a "$OUT/summary.txt"
fi

step() {  # name, limit, train_step.py arguments
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "${PYTHON:-python3}" benchmarks/train_step.py --device cuda --tokens 4096 \
    --steps-k 7 --impls diagonal --repeats 3 --json "$OUT/$name.json" "$@" \
    ${MEMORY_ONLY:+--memory-only} \
    > "$OUT/$name.log" 2>&1
  echo "$name: exit $?" | tee -a "$OUT/summary.txt"
}

step step-kimi "$STEP_S" --dims kimi --teacher-heads full draft_rows --pointwise eager compiled
step step-kimi-mla "$FAMILY_S" --dims kimi-mla --optimizers adamw muon
for dims in kimi-eagle3.1 kimi-p-eagle; do
  step "step-$dims" "$FAMILY_S" --dims "$dims"
done
tail -n 12 "$OUT"/step-*.log >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
