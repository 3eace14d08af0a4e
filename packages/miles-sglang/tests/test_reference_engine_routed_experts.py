"""The reference engine's `return_routed_experts` on a tiny Qwen3-MoE: SGLang's encoding and
shape (every token read: prompt and output but the last, x MoE layers x top-k), the experts the
model's own routers pick for those tokens, batches, and the refusals."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.training_utils.step.routing_replay import decode_routed_experts, moe_routers

PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 49, 61]]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("moe"), architecture="qwen3_moe")


def routers_choice(checkpoint, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), layers, top_k): what a plain transformers forward routes each token to."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    picked = []
    for router in moe_routers(model):
        router.register_forward_hook(lambda m, i, out: picked.append(out[-1]))
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    return torch.stack(picked, dim=1)


def test_routed_experts_are_the_routers_choice_of_every_token_read(start_engine, moe_checkpoint):
    body = {"input_ids": PROMPTS, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}}  # fmt: skip
    with start_engine(moe_checkpoint, "--enable-return-routed-experts") as url:
        answers = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        plain = httpx.post(f"{url}/generate", json={**body, "return_routed_experts": False},
                           timeout=60).json()  # fmt: skip
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        tokens = prompt + answer["output_ids"]
        experts = decode_routed_experts(answer["meta_info"]["routed_experts"], 2, 2)
        assert experts.shape == (len(tokens) - 1, 2, 2)  # the last output token is never read
        # Prefill and decode steps route as one forward over the same tokens does.
        assert torch.equal(experts, routers_choice(moe_checkpoint, tokens)[: len(tokens) - 1])
    assert all("routed_experts" not in a["meta_info"] for a in plain)


def test_routed_experts_stay_right_beside_a_sequence_that_finished_early(
    start_engine, moe_checkpoint
):
    # The first sequence finishes after 2 tokens and keeps its row (one finished of three): the
    # others' routing is read from their own rows of each later step.
    prompts = [*PROMPTS, [50, 51, 52]]
    params = [{"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True} for n in (2, 6, 6)]
    body = {"input_ids": prompts, "sampling_params": params, "return_routed_experts": True}
    with start_engine(moe_checkpoint, "--enable-return-routed-experts") as url:
        answers = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert [len(a["output_ids"]) for a in answers] == [2, 6, 6]
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens = prompt + answer["output_ids"]
        experts = decode_routed_experts(answer["meta_info"]["routed_experts"], 2, 2)
        assert torch.equal(experts, routers_choice(moe_checkpoint, tokens)[: len(tokens) - 1])


def test_asking_without_the_server_flag_is_refused(start_engine, moe_checkpoint):
    body = {"input_ids": PROMPTS[0], "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    with start_engine(moe_checkpoint) as url:
        answer = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert answer.status_code == 400
    assert "--enable-return-routed-experts" in answer.text


def test_the_flag_on_a_dense_model_is_refused_at_start(tiny_checkpoint):
    from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig
    from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine

    config = ReferenceEngineConfig(
        model_path=str(tiny_checkpoint), enable_return_routed_experts=True
    )
    with pytest.raises(ValueError, match="no top-k router; drop the flag for a dense model"):
        ReferenceEngine(config)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and sglang")
def test_sglang_reports_routed_experts_in_the_same_encoding(moe_checkpoint):
    """Routing replay's contract on a real SGLang server (--enable-return-routed-experts, as
    SGLangEngineLauncher passes it with R3): the same field, shape and encoding."""
    from miles.backends.sglang_utils.sglang_engine import SGLangEngine, SGLangEngineConfig
    from tests.support.distributed import free_port

    config = SGLangEngineConfig(
        model_path=str(moe_checkpoint), port=free_port(), mem_fraction_static=0.2,
        random_seed=0, extra_args={"enable-return-routed-experts": True},
    )  # fmt: skip
    body = {"input_ids": PROMPTS[0], "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}  # fmt: skip
    with SGLangEngine(config) as engine:
        answer = httpx.post(f"{engine.url}/generate", json=body, timeout=120).json()
    tokens = PROMPTS[0] + answer["output_ids"]
    experts = decode_routed_experts(answer["meta_info"]["routed_experts"], 2, 2)
    assert experts.shape == (len(tokens) - 1, 2, 2)
    assert int(experts.min()) >= 0 and int(experts.max()) < 4
