"""Prefix sharing in the reference engine: a prompt that arrives several times in one admission (a
GRPO group's samples) is prefilled once, and every copy continues exactly as if prefilled alone."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.model_runner import (
    ModelRunner,
    _append,
    merge_states,
    select_rows,
)
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.scheduler import Request, Scheduler

GROUP_PROMPT = [72, 101, 108, 108, 111]
OTHER_PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def runner(tiny_checkpoint) -> ModelRunner:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    return ModelRunner(model, torch.device("cpu"))


def test_repeated_prompts_are_prefilled_once_with_the_rows_of_a_lone_prefill(runner):
    before = runner.prefilled_tokens
    prompts = [GROUP_PROMPT, OTHER_PROMPT, GROUP_PROMPT, GROUP_PROMPT]
    logits, state = runner.prefill(prompts)
    assert runner.prefilled_tokens - before == len(GROUP_PROMPT) + len(OTHER_PROMPT)
    assert logits.shape[0] == state.size == 4
    for row, prompt in enumerate(prompts):
        alone_logits, alone = runner.prefill([prompt])
        real = state.mask[row].bool()  # the row's own positions, without the batch's padding
        torch.testing.assert_close(logits[row], alone_logits[0], rtol=1e-5, atol=1e-5)
        for layer in range(len(state.keys)):
            torch.testing.assert_close(state.keys[layer][row][:, real], alone.keys[layer][0])
            torch.testing.assert_close(state.values[layer][row][:, real], alone.values[layer][0])
    # The copies decode on their own: the same next-token logits as unshared rows.
    shared_next, _ = runner.decode(state, [1, 2, 1, 1])
    torch.testing.assert_close(shared_next[0], shared_next[2])
    alone_next, _ = runner.decode(runner.prefill([GROUP_PROMPT])[1], [1])
    torch.testing.assert_close(shared_next[3], alone_next[0], rtol=1e-5, atol=1e-5)


def test_a_group_admitted_together_reports_its_shared_prompt_as_cached_tokens(runner):
    scheduler = Scheduler(
        runner, eos_token_ids=set(), context_length=64, max_running_requests=8, seed=0
    )
    try:
        scheduler.pause()  # the whole group waits, then is admitted in one prefill
        finished_ids: set[str] = set()
        all_done = threading.Event()

        def on_event(request: Request, finished: bool) -> None:  # runs on the engine's thread
            if finished:
                finished_ids.add(request.rid)
                if len(finished_ids) == len(group):
                    all_done.set()

        group = [
            Request(
                input_ids=list(GROUP_PROMPT),
                params=SamplingParams(max_new_tokens=4, temperature=0.0),
                on_event=on_event,
            )
            for _ in range(3)
        ]
        for request in group:
            scheduler.submit(request)
        scheduler.resume()
        assert all_done.wait(timeout=30), "the group did not finish"
        assert [r.cached_tokens for r in group] == [0, len(GROUP_PROMPT), len(GROUP_PROMPT)]
        assert group[0].output_ids == group[1].output_ids == group[2].output_ids  # greedy
    finally:
        scheduler.shutdown()


def test_a_continuous_batch_decodes_each_row_as_its_own_full_forward_in_float64(tiny_checkpoint):
    # The running batch: left padding, grouped KV heads without copies, KV appended in place
    # (past the first buffer's room), a row leaving and a row joining midway. Each row's logits
    # must equal a full forward over that row's tokens alone, without a cache or padding (with
    # stock "sdpa": "eager" takes its softmax in float32).
    runner = ModelRunner(
        AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64),
        torch.device("cpu"),
    )
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float64, attn_implementation="sdpa"
    ).eval()
    assert runner.model.config._attn_implementation == "miles_grouped_sdpa"
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def check(logits: torch.Tensor, rows: list[list[int]]) -> None:
        for row, sequence in enumerate(rows):
            with torch.no_grad():
                expected = reference(input_ids=torch.tensor([sequence])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-9, atol=1e-9)

    rows = [tokens(3), tokens(9), tokens(5)]
    logits, state = runner.prefill(rows)
    check(logits, rows)
    for step in range(50):
        if step == 10:  # the middle row finishes
            rows.pop(1)
            state = select_rows(state, [0, 2])
        if step == 20:  # a new request joins with its own prefill
            joining = [tokens(12)]
            _, joined = runner.prefill(joining)
            state = merge_states(state, joined)
            rows += joining
        fed = tokens(len(rows))
        logits, state = runner.decode(state, fed)
        rows = [[*sequence, token] for sequence, token in zip(rows, fed, strict=True)]
        check(logits, rows)


def test_a_decode_step_appends_in_place_while_its_buffer_has_room():
    cached = torch.randn(2, 3, 4, 5)
    first = _append(cached, torch.randn(2, 3, 1, 5))  # a new buffer with room
    second = _append(first, torch.randn(2, 3, 1, 5))
    assert second.data_ptr() == first.data_ptr() and second.shape == (2, 3, 6, 5)
    torch.testing.assert_close(second[:, :, :4], cached)
    torch.testing.assert_close(second[:, :, 4], first[:, :, 4])


@pytest.mark.parametrize(
    ("config_class", "architecture"),
    [("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"), ("Qwen3NextConfig", "Qwen3NextForCausalLM")],
)
def test_a_model_with_recurrent_gdn_layers_is_refused_naming_its_architecture(
    config_class, architecture
):
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=f"cannot serve {architecture} .*--rollout-engine sglang"):
        ModelRunner(model, torch.device("cpu"))
