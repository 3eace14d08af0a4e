"""The VLM example's task: name the colour of the shapes in a small picture, e.g. -> "red".

Each picture is 112x112 pixels (16 image tokens for the tiny Qwen2.5-VL: a token is one merged
2x2 group of 14-pixel patches) holding 1 to 3 circles and squares of one colour (red, green or
blue) at random places and sizes. The example makes its own pictures (PIL) and data files, seeded,
into a directory:
- `format.jsonl`: warm-up rows whose answer is the true colour half the time and another colour
  otherwise, so supervised training teaches the answer format (a colour word, then end of text)
  but leaves the rule uncertain;
- `train.jsonl`: RL prompts with the true colour as label, for the exact-match reward;
- `eval.jsonl`: held-out pictures, drawn apart from the training ones.
Images are PNG files under `images/`, named in the rows by paths relative to the data files.

Why colours and not "how many red circles?": counting is beyond the tiny model in a CPU budget
(trained on true counts for 8 epochs it stays at the answer prior), while colour it learns from
the pixels within a few epochs, so the example shows RL improving on what the model sees.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

SEED = 0
SIZE = 112
QUESTION = "What colour?"
RADIUS = (22, 32)
"""Smallest and largest half-width of a shape, in pixels."""
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}


def draw(colour: str, rng: random.Random) -> Image.Image:
    """1-3 circles and squares of `colour` on white."""
    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 3)):
        radius = rng.randint(*RADIUS)
        cx, cy = rng.randint(radius, SIZE - radius), rng.randint(radius, SIZE - radius)
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        shape = pen.ellipse if rng.random() < 0.5 else pen.rectangle
        shape(box, fill=COLOURS[colour])
    return image


def build(out: Path, seed: int = SEED, *, train: int = 96, evaluation: int = 24) -> dict[str, int]:
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)

    def row(split: str, number: int, label: str) -> dict:
        name = f"images/{split}_{number:04d}.png"
        colour = rng.choice(list(COLOURS))
        draw(colour, rng).save(out / name)
        answer = colour if label == "true" else rng.choice([c for c in COLOURS if c != colour])
        return {"input": QUESTION, "images": [name], "label": answer}

    files = {
        "train": [row("train", i, "true") for i in range(train)],
        "format": [row("format", i, "true" if rng.random() < 0.5 else "other")
                   for i in range(train)],
        "eval": [row("eval", i, "true") for i in range(evaluation)],
    }  # fmt: skip
    for name, rows in files.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {name: len(rows) for name, rows in files.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", help="directory to write the data files and images to")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    for name, count in build(Path(args.out), args.seed).items():
        print(f"{Path(args.out) / name}.jsonl: {count} rows")


if __name__ == "__main__":
    main()
