"""docs/guides/recipes.md, "Evaluation on several datasets": the page shows the CPU demo's eval
config as it is in examples/ (which packages/miles/tests/test_eval_config.py loads), and its
command line builds that configuration."""

from __future__ import annotations

import shlex
from pathlib import Path

from miles.config import load_config
from tests.docs.guide import block, blocks

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/cpu_demo/eval_config.yaml"


def test_the_page_shows_the_example_file_as_it_is():
    shown = block("recipes.md", EXAMPLE, language="yaml")
    assert shown.split("\n", 1)[1] == (REPO / EXAMPLE).read_text()


def test_the_pages_command_evaluates_the_three_datasets(monkeypatch):
    monkeypatch.chdir(REPO)
    (command,) = [b for b in blocks("recipes.md", "bash") if f"--eval-config {EXAMPLE}" in b]
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == ["miles", "train"]
    # The demo's SFT checkpoint is made by run.sh; a hub id stands in for it (nothing is read).
    argv[argv.index("--hf-checkpoint") + 1] = "ckpt"
    config = load_config(argv[2:])
    assert [d.name for d in config.eval.eval_datasets] == ["heldout", "heldout_greedy", "train_f1"]
    assert config.eval.eval_prompt_data is None
