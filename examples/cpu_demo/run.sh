#!/usr/bin/env bash
# The CPU demo, end to end: a tiny Qwen3 learns to answer max(a,b) on a laptop CPU.
#   1. build the model (seeded) and its byte-level tokenizer locally: nothing is downloaded;
#   2. supervised warm-up: the answer format, with answers right only half the time;
#   3. GRPO with an exact-match reward: the rule, evaluated on held-out digit pairs;
#   4. PNG curves of both stages and a summary of the held-out reward.
# Run from anywhere: `bash examples/cpu_demo/run.sh` (about 5 minutes on 2 cores). Extra arguments
# go to both `miles train` calls (e.g. --console rich, --seed 7 --rollout-seed 7). Output goes to
# $MILES_DEMO_OUT (default runs/cpu_demo); $MILES_DEMO_MODEL_SEED seeds the initial weights.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${MILES_DEMO_OUT:-runs/cpu_demo}
rm -rf "$OUT"
python -m miles.backends.sglang_utils.tiny_checkpoint "$OUT/base" --seed "${MILES_DEMO_MODEL_SEED:-0}"
miles train --config examples/cpu_demo/sft.yaml \
  --hf-checkpoint "$OUT/base" --save "$OUT/sft" --output-dir "$OUT/sft" "$@"
miles export-hf "$OUT/sft" "$OUT/sft_hf"
miles train --config examples/cpu_demo/grpo.yaml \
  --hf-checkpoint "$OUT/sft_hf" --save "$OUT/grpo/checkpoints" --output-dir "$OUT/grpo" "$@"
miles plot "$OUT/sft"
miles plot "$OUT/grpo"
python examples/cpu_demo/summary.py "$OUT"
