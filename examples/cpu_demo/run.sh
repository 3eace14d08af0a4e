#!/usr/bin/env bash
# The CPU demo, end to end: a tiny Qwen3 learns to answer max(a,b) on a laptop CPU.
#   1. build the model (seeded) and its byte-level tokenizer locally: nothing is downloaded;
#   2. supervised warm-up: the answer format, with answers right only half the time;
#   3. GRPO with an exact-match reward: the rule; evaluation on held-out digit pairs;
#   4. PNG curves of both stages.
# Run from the repository root: `bash examples/cpu_demo/run.sh` (about 5 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=runs/cpu_demo
rm -rf "$OUT"
python -m miles.backends.sglang_utils.tiny_checkpoint "$OUT/base" --seed 0
miles train --config examples/cpu_demo/sft.yaml "$@"
miles export-hf "$OUT/sft" "$OUT/sft_hf"
miles train --config examples/cpu_demo/grpo.yaml "$@"
miles plot "$OUT/sft"
miles plot "$OUT/grpo"
python examples/cpu_demo/summary.py "$OUT"
