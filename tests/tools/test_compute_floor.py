"""bench/compute_floor.py: its FLOP formula against torch's own FLOP counter on a real Qwen3."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, DynamicCache

from bench.compute_floor import (
    ModelShape,
    RolloutShape,
    generation_flops,
    sgemm_gflops,
    training_flops,
)
from miles.backends.sglang_utils.tiny_checkpoint import tiny_qwen3_config

# Attention is a sizeable share of the FLOPs at this length (~20%), so a wrong term shows.
BATCH, LENGTH = 2, 64


@pytest.fixture(scope="module")
def qwen3():
    torch.manual_seed(0)
    # Eager attention: its matmuls are what the counter sees on CPU, where sdpa's kernel is not
    # registered with it.
    config = tiny_qwen3_config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, attn_implementation="eager",
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config), ModelShape.from_config(config)


def _counted(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def _masked_pairs(length: int) -> float:
    """(query, key) pairs above the diagonal: a dense kernel multiplies them before masking, the
    formula (the floor) leaves them out."""
    return length * length - length * (length + 1) / 2


def test_forward_flops_match_torch_flop_counter(qwen3):
    model, shape = qwen3
    ids = torch.randint(0, shape.vocab, (BATCH, LENGTH))
    with torch.no_grad():
        counted = _counted(lambda: model(input_ids=ids))
    expected = BATCH * (shape.forward_flops(LENGTH) + _masked_pairs(LENGTH) * shape.pair_flops)
    assert counted == pytest.approx(expected, rel=0.01)


def test_backward_costs_twice_the_forward(qwen3):
    model, shape = qwen3
    ids = torch.randint(0, shape.vocab, (BATCH, LENGTH))
    counted = _counted(lambda: model(input_ids=ids).logits.sum().backward())
    expected = 3 * BATCH * (shape.forward_flops(LENGTH) + _masked_pairs(LENGTH) * shape.pair_flops)
    assert counted == pytest.approx(expected, rel=0.01)


def test_generation_with_a_kv_cache_matches_torch_flop_counter(qwen3):
    # One group: the prompt prefilled once, then each sample decoded on a copy of its cache,
    # token by token (each new token's query against the keys before it: no masked pairs).
    model, shape = qwen3
    prompt_len, response_len, samples = 24, 6, 2
    prompt = torch.randint(0, shape.vocab, (1, prompt_len))

    def generate():
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for _ in range(samples):
            own = copy.deepcopy(cache)
            for _ in range(response_len - 1):  # the last token is sampled, never forwarded
                token = torch.randint(0, shape.vocab, (1, 1))
                model(input_ids=token, past_key_values=own, use_cache=True)

    with torch.no_grad():
        counted = _counted(generate)
    rollout = RolloutShape(
        prompts=1, samples=samples, prompt_len=prompt_len, response_len=response_len
    )
    expected = (
        generation_flops(shape, rollout, share_prompt=True)
        + _masked_pairs(prompt_len) * shape.pair_flops  # the prefill's dense kernel
    )
    assert counted == pytest.approx(expected, rel=0.01)


def test_a_shared_prompt_saves_the_repeated_prompt_forwards():
    shape = ModelShape(hidden=8, intermediate=16, layers=1, heads=2, kv_heads=1, head_dim=4,
                       vocab=10)  # fmt: skip
    rollout = RolloutShape(prompts=2, samples=4, prompt_len=5, response_len=3)
    shared = training_flops(shape, rollout, share_prompt=True)
    per_sample = training_flops(shape, rollout, share_prompt=False)
    # The same responses against the same keys; only 2 x 3 prompt forwards are saved.
    assert per_sample - shared == pytest.approx(3 * 2 * 3 * shape.forward_flops(5))


def test_sgemm_rate_is_positive_and_leaves_the_thread_setting_as_it_was():
    before = torch.get_num_threads()
    assert sgemm_gflops(1, size=128, repeats=2) > 0
    assert torch.get_num_threads() == before
