"""The tool-use example's task: multiply two 2-digit numbers ("What is 47*86?" -> "4042"), which
the tiny model cannot do in its head and can with the calculator of tools.py.

Writes the data files shipped next to this script (run it again to regenerate them; the seed fixes
the content):
- `data/warmup.jsonl`: supervised warm-up rows (chat -> label) teaching the format of an episode
  but not the best policy. For each problem: the call turn (the question -> a calculator call),
  the answer turn (the question, the call and the calculator's result -> the result), and a guess
  (the question -> a wrong number, answered in the head). After the warm-up the model calls the
  calculator about half the time; GRPO has to find that calling it always pays.
- `data/train.jsonl`: RL prompts with the product as label, for the exact-match reward, and a few
  divisions the calculator fails on: by zero (it raises) and with a never-ending decimal (it
  hangs until --tool-timeout-s), so every run exercises both failures;
- `data/eval.jsonl`: held-out products, in no other file.

Each label ends the assistant's turn as the chat template does (`<|im_end|>`); the GRPO stage stops
generating there (--rollout-stop-token-ids), so an episode's tokens are exactly the template's.
Every expression has 5 characters: the model copies it, and the result, from a fixed distance.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

SEED = 0
TURN_END = "<|im_end|>"
NUM_EVAL, NUM_WARMUP, NUM_TRAIN, NUM_FAILING = 32, 256, 256, 16


def question(expression: str) -> str:
    return f"What is {expression}?"


def call(expression: str) -> dict:
    """An assistant turn calling the calculator, as the chat template renders it."""
    function = {"name": "calc", "arguments": {"expr": expression}}
    return {"role": "assistant", "content": "", "tool_calls": [{"function": function}]}


def call_text(expression: str) -> str:
    return f'<tool_call>{{"name":"calc","arguments":{{"expr":"{expression}"}}}}</tool_call>'


def warmup_rows(a: int, b: int, rng: random.Random) -> list[dict]:
    expression, product = f"{a}*{b}", a * b
    asked = {"role": "user", "content": question(expression)}
    guess = rng.choice([n for n in range(1000, 10000) if n != product])
    called = [asked, call(expression), {"role": "tool", "content": str(product)}]
    return [
        {"input": [asked], "label": call_text(expression) + TURN_END},
        {"input": called, "label": f"{product}{TURN_END}"},
        {"input": [asked], "label": f"{guess}{TURN_END}"},
    ]


def repeats(a: int, b: int) -> bool:
    """Whether a/b has a never-ending decimal (the calculator hangs on it)."""
    while b % 2 == 0:
        b //= 2
    while b % 5 == 0:
        b //= 5
    return a % b != 0


def failing_divisions(rng: random.Random, count: int) -> list[dict]:
    """`count` divisions by zero ("123/0") and `count` with a repeating decimal ("47/86")."""
    by_zero = [{"input": question(f"{a}/0"), "label": "undefined"}
               for a in rng.sample(range(100, 1000), count)]  # fmt: skip
    pairs = [(a, b) for a, b in itertools.product(range(10, 100), repeat=2) if repeats(a, b)]
    endless = [{"input": question(f"{a}/{b}"), "label": f"{a / b:.4f}"}
               for a, b in rng.sample(pairs, count)]  # fmt: skip
    return by_zero + endless


def build(seed: int = SEED) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    products = [(a, b) for a, b in itertools.product(range(10, 100), repeat=2) if a * b >= 1000]
    rng.shuffle(products)
    held_out, seen = products[:NUM_EVAL], products[NUM_EVAL:]
    warmup = [row for a, b in seen[:NUM_WARMUP] for row in warmup_rows(a, b, rng)]
    # Division calls too, so the warm-up teaches copying a "/" (their results are not taught).
    warmup += [
        {"input": [{"role": "user", "content": row["input"]}],
         "label": call_text(row["input"][len("What is "):-1]) + TURN_END}
        for row in failing_divisions(rng, NUM_FAILING // 2)
    ]  # fmt: skip
    rng.shuffle(warmup)
    train = [
        {"input": question(f"{a}*{b}"), "label": str(a * b)} for a, b in rng.sample(seen, NUM_TRAIN)
    ]
    train += failing_divisions(rng, NUM_FAILING)
    rng.shuffle(train)
    evaluation = [{"input": question(f"{a}*{b}"), "label": str(a * b)} for a, b in held_out]
    return {"warmup": warmup, "train": train, "eval": evaluation}


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
