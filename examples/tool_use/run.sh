#!/usr/bin/env bash
# The tool-use example, end to end: a tiny Qwen3 learns to multiply 2-digit numbers by calling a
# calculator, on a laptop CPU.
#   1. build the model (seeded) and its byte-level tokenizer locally: nothing is downloaded;
#   2. supervised warm-up on episodes' turns: the call and answer format, and guessing half the time;
#   3. GRPO over multi-turn episodes with the calculator, exact-match reward on the last answer;
#   4. PNG curves of both stages and a summary: held-out reward, tool calls and tool failures.
# Run from anywhere: `bash examples/tool_use/run.sh` (about 4 minutes on 2 cores). Extra arguments
# go to both `miles train` calls (e.g. --console rich, --seed 7 --rollout-seed 7). Output goes to
# $MILES_EXAMPLE_OUT (default runs/tool_use); $MILES_EXAMPLE_MODEL_SEED seeds the initial weights.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${MILES_EXAMPLE_OUT:-runs/tool_use}
# The calculator is imported by path (examples.tool_use.tools:calculator) in every process.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$OUT"
python -m miles.backends.sglang_utils.tiny_checkpoint "$OUT/base" \
  --seed "${MILES_EXAMPLE_MODEL_SEED:-0}" --hidden-size 128 --intermediate-size 256
miles train --config examples/tool_use/sft.yaml \
  --hf-checkpoint "$OUT/base" --save "$OUT/sft" --output-dir "$OUT/sft" "$@"
miles export-hf "$OUT/sft" "$OUT/sft_hf"
miles train --config examples/tool_use/grpo.yaml \
  --hf-checkpoint "$OUT/sft_hf" --save "$OUT/grpo/checkpoints" --output-dir "$OUT/grpo" "$@"
miles plot "$OUT/sft"
miles plot "$OUT/grpo"
python examples/tool_use/summary.py "$OUT"
