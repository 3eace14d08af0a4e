#!/usr/bin/env bash
# The VLM example, end to end: a tiny Qwen2.5-VL learns to name the colour of the shapes it sees.
#   1. draw the pictures and write the data (seeded, PIL), build the model (seeded) with its
#      processor locally: nothing is downloaded;
#   2. supervised warm-up: the answer format, with answers right only half the time;
#   3. GRPO with an exact-match reward, evaluated on held-out pictures;
#   4. PNG curves of both stages and a summary of the held-out reward.
# Run from anywhere: `bash examples/vlm_shapes/run.sh`. Extra arguments go to both `miles train`
# calls (e.g. --seed 7 --rollout-seed 7). Output goes to $MILES_VLM_OUT (default runs/vlm_shapes);
# $MILES_VLM_MODEL_SEED seeds the initial weights.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${MILES_VLM_OUT:-runs/vlm_shapes}
rm -rf "$OUT"
python examples/vlm_shapes/task.py "$OUT/data"
python -m miles.backends.sglang_utils.tiny_checkpoint "$OUT/base" --architecture qwen2_5_vl \
  --seed "${MILES_VLM_MODEL_SEED:-0}"
EVAL=(--eval-prompt-data heldout "$OUT/data/eval.jsonl")
miles train --config examples/vlm_shapes/sft.yaml --prompt-data "$OUT/data/format.jsonl" \
  "${EVAL[@]}" --hf-checkpoint "$OUT/base" --save "$OUT/sft" --output-dir "$OUT/sft" "$@"
miles export-hf "$OUT/sft" "$OUT/sft_hf"
miles train --config examples/vlm_shapes/grpo.yaml --prompt-data "$OUT/data/train.jsonl" \
  "${EVAL[@]}" --hf-checkpoint "$OUT/sft_hf" --save "$OUT/grpo/checkpoints" \
  --output-dir "$OUT/grpo" "$@"
miles plot "$OUT/sft"
miles plot "$OUT/grpo"
# The CPU demo's summary reads the same two stages' held-out reward.
python examples/cpu_demo/summary.py "$OUT"
