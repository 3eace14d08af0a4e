"""Prefix sharing in the reference engine: a prompt that arrives several times in one admission (a
GRPO group's samples) is prefilled once, and every copy continues exactly as if prefilled alone."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.batch_cache import (
    append_kv,
    merge_states,
    select_rows,
)
from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
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


def _float64_model(name: str, tiny_checkpoint) -> torch.nn.Module:
    """A float64 model with stock "sdpa" of each architecture the fast decode path covers (Qwen3
    with q/k norms, Qwen2 with q/k/v biases, Llama with llama3 rope scaling and an MLP bias)."""
    if name == "qwen3":
        return AutoModelForCausalLM.from_pretrained(
            tiny_checkpoint, dtype=torch.float64, attn_implementation="sdpa"
        )
    import transformers

    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    if name == "qwen2":
        config = transformers.Qwen2Config(**common)
    else:
        config = transformers.LlamaConfig(
            **common, mlp_bias=True, head_dim=8,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32},
        )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # nonzero biases, so a dropped bias cannot pass
        for name_, param in model.named_parameters():
            if name_.endswith("bias"):
                param.normal_(std=0.1)
    return model.to(torch.float64)


@pytest.mark.parametrize(
    ("architecture", "fast_decode"),
    [("qwen3", False), ("qwen3", True), ("qwen2", True), ("llama", True)],
)
def test_a_continuous_batch_decodes_each_row_as_its_own_full_forward_in_float64(
    tiny_checkpoint, architecture, fast_decode
):
    # The running batch: left padding, grouped KV heads without copies, KV appended in place
    # (past the first buffer's room), a row leaving and a row joining midway. Each row's logits
    # must equal a full forward over that row's tokens alone, without a cache or padding (with
    # stock "sdpa": "eager" takes its softmax in float32), on the HF forward and the fast path.
    reference = _float64_model(architecture, tiny_checkpoint).eval()
    runner = ModelRunner(copy.deepcopy(reference), torch.device("cpu"), fast_decode=fast_decode)
    assert runner.model.config._attn_implementation == "miles_grouped_sdpa"
    assert (runner.decoder is not None) == fast_decode
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
    for step in range(40):
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


def test_the_fast_decode_path_reads_weights_updated_after_it_was_built(tiny_checkpoint):
    # Weight sync copies into the parameters or replaces them; the next step must use them.
    reference = _float64_model("qwen3", tiny_checkpoint).eval()
    runner = ModelRunner(copy.deepcopy(reference), torch.device("cpu"))
    with torch.no_grad():
        for model in (reference, runner.model):
            model.model.layers[0].mlp.up_proj.weight.mul_(3.0)
            attention = model.model.layers[1].self_attn
            attention.o_proj.weight = torch.nn.Parameter(attention.o_proj.weight.flip(0))
        _, state = runner.prefill([[1, 2, 3], [4, 5]])
        logits, _ = runner.decode(state, [6, 7])
        for row, sequence in enumerate([[1, 2, 3, 6], [4, 5, 7]]):
            expected = reference(input_ids=torch.tensor([sequence])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("moe", "has no fast decode path"),
        ("recorded", "routed experts are recorded"),
        ("hooked", "forward hooks on"),
        ("sliding", "windowed attention"),
        ("off", "turned off"),
    ],
)
def test_models_the_fast_path_does_not_reproduce_keep_the_hf_forward(variant, reason, caplog):
    import transformers

    from miles.backends.sglang_utils.tiny_checkpoint import tiny_qwen3_config, tiny_qwen3_moe_config

    if variant in ("moe", "recorded"):
        config = tiny_qwen3_moe_config()
    elif variant == "sliding":
        config = transformers.Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
            sliding_window=16, max_window_layers=1,
        )  # fmt: skip
    else:
        config = tiny_qwen3_config()
    model = AutoModelForCausalLM.from_config(config)
    if variant == "hooked":
        model.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    with caplog.at_level("INFO", logger="miles.backends.sglang_utils.reference_engine"):
        runner = ModelRunner(
            model, torch.device("cpu"), record_routed_experts=variant == "recorded",
            fast_decode=variant != "off",
        )  # fmt: skip
    assert runner.decoder is None
    assert "HF forward" in caplog.text and reason in caplog.text
    _, state = runner.prefill([[1, 2, 3]])
    logits, _ = runner.decode(state, [4])  # the HF forward still decodes
    assert logits.shape == (1, config.vocab_size)


def test_a_decode_step_appends_in_place_while_its_buffer_has_room():
    cached = torch.randn(2, 3, 4, 5)
    first = append_kv(cached, torch.randn(2, 3, 1, 5))  # a new buffer with room
    second = append_kv(first, torch.randn(2, 3, 1, 5))
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


@pytest.mark.parametrize(("flags", "fast"), [((), True), (("--disable-fast-decode",), False)])
def test_the_server_flag_chooses_the_decode_path(tiny_checkpoint, flags, fast):
    from miles.backends.sglang_utils.reference_engine.cli import build_parser, engine_options
    from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig
    from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine

    args = build_parser().parse_args(["--model-path", str(tiny_checkpoint), *flags])
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_options(args)))
    try:
        assert (engine.scheduler.runner.decoder is not None) == fast
    finally:
        engine.scheduler.shutdown()
