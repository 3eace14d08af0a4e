"""LoRA adapters made with PEFT, and the check that an engine serving one scores tokens as PEFT's
own forward does. Self-contained (torch, transformers, peft, httpx), so a trainer's tests can take
it as it is (e.g. into tests/support/) to check an adapter they pushed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch
from transformers import AutoModelForCausalLM

if TYPE_CHECKING:  # peft takes a second to import: only the tests that build adapters pay it
    from peft import PeftModel

LORA_ADMIN_KEY = "lora-admin-key"
"""The admin key of the tests' LoRA engine (`lora_engine_url`): the LoRA routes are admin routes."""
LORA_ENGINE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
"""The LoRA engine's --lora-target-modules: every projection but gate_proj, so that an adapter of
gate_proj is one the flags refuse."""


def make_peft_model(
    base_path: str | Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] = ("q_proj", "v_proj", "down_proj"),
    seed: int = 0,
    use_rslora: bool = False,
) -> PeftModel:
    """A float32 PeftModel over the checkpoint at `base_path` whose B matrices are random (PEFT
    starts them at zero, which would leave the outputs unchanged), seeded."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        lora_dropout=0.0, use_rslora=use_rslora)  # fmt: skip
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # A and B both random: a large enough change to see
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def save_adapter(model: PeftModel, out_dir: str | Path) -> Path:
    """`model`'s adapter as PEFT saves it (adapter_config.json + adapter_model.safetensors)."""
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def adapter_tensors(model: PeftModel) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs as `peft.get_peft_model_state_dict` names them."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model).items())


@torch.no_grad()
def model_token_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """log p(token_ids[t] | token_ids[:t]) for t = 1 .. T-1 under `model` (float32, (T-1,))."""
    ids = torch.tensor([token_ids])
    logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def engine_token_logprobs(
    engine: httpx.Client, token_ids: list[int], *, lora_path: str | None = None
) -> torch.Tensor:
    """The same log-probs from an engine's /generate (SGLang's prompt log-probs: return_logprob,
    logprob_start_len 0, max_new_tokens 0), run with adapter `lora_path`. `engine`: a client
    whose base_url is the engine."""
    body = {"input_ids": token_ids, "return_logprob": True, "logprob_start_len": 0,
            "lora_path": lora_path, "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    answer = engine.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    listed = answer.json()["meta_info"]["input_token_logprobs"]
    assert listed[0][0] is None, "SGLang lists no log-prob for the first prompt position"
    return torch.tensor([logprob for logprob, _, _ in listed[1:]], dtype=torch.float32)


def engine_greedy(
    engine: httpx.Client, prompt: list[int], *, lora_path: str | None, tokens: int = 6
) -> tuple[list[int], torch.Tensor]:
    """`tokens` greedy tokens after `prompt` with adapter `lora_path`, and their log-probs (the
    model's own distribution: temperature 0 scores at temperature 1)."""
    body = {"input_ids": prompt, "return_logprob": True, "lora_path": lora_path,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens,
                                "ignore_eos": True}}  # fmt: skip
    answer = engine.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    logprobs = [logprob for logprob, _, _ in result["meta_info"]["output_token_logprobs"]]
    return result["output_ids"], torch.tensor(logprobs, dtype=torch.float32)


def assert_engine_matches_model(
    engine: httpx.Client,
    model: torch.nn.Module,
    prompt: list[int],
    *,
    lora_path: str | None,
    atol: float = 1e-4,
) -> None:
    """What the engine computes with adapter `lora_path` is what `model` (a PeftModel holding
    the same adapter, or the base model for None) computes: the prompt's log-probs (prefill),
    and greedy tokens with their log-probs (decode steps), each scored by `model` after the
    prompt and the tokens before it."""
    served = engine_token_logprobs(engine, prompt, lora_path=lora_path)
    torch.testing.assert_close(served, model_token_logprobs(model, prompt), rtol=0, atol=atol)
    output, logprobs = engine_greedy(engine, prompt, lora_path=lora_path)
    expected = model_token_logprobs(model, prompt + output)[len(prompt) - 1 :]
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=atol)
