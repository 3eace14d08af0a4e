"""Engine-side loading: by Hugging Face name, all-or-nothing, tied weights under either name."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.sglang_utils.weight_sync import WeightUpdateError, load_named_tensors
from miles.backends.sglang_utils.weight_sync.loader import _all_finite


def _tiny_qwen3(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture
def engine() -> torch.nn.Module:
    return _tiny_qwen3(seed=0)


@pytest.fixture(scope="module")
def trainer() -> torch.nn.Module:
    return _tiny_qwen3(seed=1)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_loading_a_full_state_dict_makes_the_models_equal(engine, trainer):
    count = load_named_tensors(engine, ((k, v) for k, v in trainer.state_dict().items()))
    assert count == len(trainer.state_dict())
    for name, value in trainer.state_dict().items():
        assert torch.equal(engine.state_dict()[name], value), name


def test_tensors_are_cast_to_the_parameters_dtype(engine, trainer):
    name = "model.layers.0.self_attn.q_proj.weight"
    source = trainer.state_dict()[name].double()
    load_named_tensors(engine, [(name, source)])
    target = engine.get_parameter(name)
    assert target.dtype == torch.float32 and torch.equal(target, source.float())
    assert not target.requires_grad or target.grad is None


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_tied_embedding_loads_under_either_name(engine, name):
    new = torch.full((128, 32), 0.5)
    assert load_named_tensors(engine, [(name, new)]) == 1
    assert torch.equal(engine.lm_head.weight, new)
    assert torch.equal(engine.model.embed_tokens.weight, new)


def test_unknown_name_changes_nothing_and_suggests_the_closest_name(engine, trainer):
    before = _snapshot(engine)
    good = list(trainer.state_dict().items())[:3]
    bad = ("model.layers.0.self_attn.q_proj.weigth", torch.zeros(32, 32))
    with pytest.raises(
        WeightUpdateError, match=re.escape("did you mean 'model.layers.0.self_attn.q_proj.weight'")
    ):
        load_named_tensors(engine, [*good, bad])
    for name, value in engine.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed although the update was refused"


def test_shape_mismatch_changes_nothing_and_shows_both_shapes(engine, trainer):
    before = _snapshot(engine)
    good = list(trainer.state_dict().items())[:3]
    with pytest.raises(WeightUpdateError, match=r"\(32, 16\) but the model's is \(32,\)") as info:
        load_named_tensors(engine, [*good, ("model.norm.weight", torch.ones(32, 16))])
    assert isinstance(info.value, ValueError)
    for name, value in engine.state_dict().items():
        assert torch.equal(value, before[name])


def test_every_problem_is_reported_at_once(engine):
    with pytest.raises(
        WeightUpdateError, match=r"^7 of the 7 tensors sent cannot be loaded, so"
    ) as info:
        load_named_tensors(engine, [(f"nope.{i}", torch.zeros(1)) for i in range(7)])
    assert "and 2 more" in str(info.value)


def test_a_whole_checkpoint_counts_what_was_refused_and_what_was_not_sent_apart(engine, trainer):
    sent = [*list(trainer.state_dict().items())[:2], ("nope", torch.zeros(1))]
    missing = len(list(engine.named_parameters())) - 2
    with pytest.raises(WeightUpdateError) as info:
        load_named_tensors(engine, sent, complete=True)
    assert str(info.value).startswith(
        f"1 of the 3 tensors sent cannot be loaded and {missing} of the model's parameters were "
        "not sent, so nothing was loaded: "
    )


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    values=st.lists(
        st.one_of(
            st.floats(allow_nan=False, allow_infinity=False, width=16),
            st.sampled_from([60000.0, -60000.0, 3e38, -3e38]),  # finite, but their sum overflows
            st.sampled_from([float("nan"), float("inf"), float("-inf")]),
        ),
        min_size=1,
        max_size=64,
    ),
)
def test_the_finite_check_agrees_with_isfinite_on_every_value(dtype, values):
    # The loader proves finiteness by one sum; a sum that overflows must not refuse finite values.
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert _all_finite(tensor) == bool(torch.isfinite(tensor).all())


def test_a_finite_update_whose_sum_overflows_loads(engine):
    big = torch.full_like(engine.model.norm.weight, 60000.0, dtype=torch.float16)
    load_named_tensors(engine, [("model.norm.weight", big)])
    assert bool((engine.model.norm.weight == 60000.0).all())


def test_a_large_update_copies_on_several_threads_into_transposed_weights_exactly():
    """Above the parallel threshold the copies run on a thread pool; weights the engine keeps
    transposed (column-major) still end equal to what was sent."""
    from miles.backends.sglang_utils.reference_engine.weight_layout import transpose_linear_weights

    torch.manual_seed(0)
    engine = torch.nn.Sequential(*[torch.nn.Linear(512, 1024) for _ in range(6)])  # 12.6 MB
    assert transpose_linear_weights(engine, torch.device("cpu")) == 6
    sent = {name: torch.randn_like(t) for name, t in engine.state_dict().items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert load_named_tensors(engine, sent.items()) == len(sent)
    finally:
        torch.set_num_threads(threads)
    for name, tensor in engine.state_dict().items():
        assert torch.equal(tensor, sent[name]), name
    assert engine[0].weight.stride() == (1, 1024)  # the layout stays
