"""The CPU demo's task: answer the larger of two digits, e.g. "max(3,8)=" -> "8".

Writes the data files shipped next to this script (run it again to regenerate them; the seed fixes
the content):
- `data/format.jsonl`: warm-up data whose answer is one of the two digits at random, so supervised
  training teaches the answer format but not the rule (the model ends it at about 50% accuracy);
- `data/train.jsonl`: RL prompts with the true answer as label, for the exact-match reward;
- `data/eval.jsonl`: held-out digit pairs, every ordered pair not in the training prompts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

SEED = 0


def prompt(a: int, b: int) -> str:
    return f"max({a},{b})="


def build(seed: int = SEED) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    pairs = [(a, b) for a, b in itertools.product(range(10), repeat=2) if a != b]
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:20], pairs[20:]
    train = [{"input": prompt(a, b), "label": str(max(a, b))} for a, b in train_pairs]
    warmup = [
        {"input": prompt(a, b), "label": str(rng.choice((a, b)))}
        for a, b in train_pairs
        for _ in range(4)
    ]
    rng.shuffle(warmup)
    evaluation = [{"input": prompt(a, b), "label": str(max(a, b))} for a, b in eval_pairs]
    return {"format": warmup, "train": train, "eval": evaluation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in build(args.seed).items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
