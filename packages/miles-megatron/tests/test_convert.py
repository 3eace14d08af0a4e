"""HF <-> Megatron weight conversion for tiny Qwen2 (q/k/v bias), Qwen3 (q/k norm, tied embeddings)
and Llama (untied) models, all with grouped-query attention and a vocabulary that needs padding.

The conversion is checked three ways: round trips are bit-identical, the fused layouts match a
hand-built example, and a real megatron-core GPTModel (local layer spec, on CPU) loads the
converted weights with exactly its own key set and computes the HF model's logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from miles.backends.megatron_utils.arguments import padded_vocab_size
from miles.backends.megatron_utils.convert import (
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_hf_named,
)

from .cpu_shim import install_megatron_cpu_shim, run_distributed

VOCAB = 259  # pads to 384 (128 x tp 1) or 512 (tp 2)
ARCHS = ("qwen2", "qwen3", "llama")


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "qwen3":
        # head_dim x heads (48) != hidden (32), as in real Qwen3 models.
        return transformers.Qwen3Config(**common, head_dim=12, tie_word_embeddings=True)
    return transformers.LlamaConfig(**common, head_dim=8, tie_word_embeddings=False)


def tiny_hf_model(arch: str) -> transformers.PreTrainedModel:
    """A tiny HF model whose every weight is random (norms and biases too, so that a misplaced
    row shows), without tied duplicates."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def hf_state(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict as a checkpoint holds it: a tied lm_head is not stored separately."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def expected_megatron_names(config) -> set[str]:
    """Megatron GPTModel parameter names of the local layer spec (also checked against a real
    GPTModel in test_a_real_gpt_model_loads_the_converted_weights_and_matches_hf_logits)."""
    names = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if not config.tie_word_embeddings:
        names.add("output_layer.weight")
    for i in range(config.num_hidden_layers):
        layer = f"decoder.layers.{i}."
        leaves = [
            "input_layernorm.weight",
            "self_attention.linear_qkv.weight",
            "self_attention.linear_proj.weight",
            "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        ]
        if config.model_type == "qwen2":
            leaves.append("self_attention.linear_qkv.bias")
        if config.model_type == "qwen3":
            leaves += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
        names.update(layer + leaf for leaf in leaves)
    return names


@pytest.fixture(scope="module", params=ARCHS)
def model(request) -> transformers.PreTrainedModel:
    return tiny_hf_model(request.param)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_hf_to_megatron_to_hf_is_bit_identical_with_no_key_lost_or_added(model, tp_size):
    state = hf_state(model)
    mg = hf_to_megatron(state, model.config, tp_size=tp_size)
    assert set(mg) == expected_megatron_names(model.config)
    back = megatron_to_hf(mg, model.config)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_vocabulary_rows_are_padded_with_zeros_to_megatrons_size(model):
    state = hf_state(model)
    mg = hf_to_megatron(state, model.config, vocab_divisible_by=128, tp_size=2)
    vocab_tensors = ["embedding.word_embeddings.weight"]
    if not model.config.tie_word_embeddings:
        vocab_tensors.append("output_layer.weight")
    for name in vocab_tensors:
        assert mg[name].shape == (padded_vocab_size(VOCAB, 128, 2), 32) == (512, 32)
        assert torch.equal(mg[name][VOCAB:], torch.zeros(512 - VOCAB, 32))


def test_megatron_to_hf_named_streams_the_same_tensors_as_the_whole_dict(model):
    mg = hf_to_megatron(hf_state(model), model.config)
    whole = megatron_to_hf(mg, model.config)
    streamed = {}
    for name, tensor in mg.items():
        # Wrapper prefixes (DDP, Float16Module) are stripped.
        for hf_name, hf_tensor in megatron_to_hf_named(
            "module.module." + name, tensor, model.config
        ):
            assert hf_name not in streamed
            assert hf_tensor.is_contiguous(), hf_name
            streamed[hf_name] = hf_tensor
    assert streamed.keys() == whole.keys()
    assert all(torch.equal(streamed[k], whole[k]) for k in whole)
    assert megatron_to_hf_named("output_layer._extra_state", torch.empty(0), model.config) == []


def test_qkv_fuses_per_query_group_q_rows_then_k_then_v():
    config = tiny_config("llama")  # 4 heads in 2 groups of 2, head_dim 8
    state = hf_state(tiny_hf_model("llama"))
    hd, hidden = 8, 32
    # Label every row: q head h, dim d -> 100 h + d; k group g -> 1000 + 100 g + d; v -> 2000 + ...
    rows = torch.arange(hd, dtype=torch.float32)
    q = torch.cat([100 * h + rows for h in range(4)])[:, None].expand(-1, hidden)
    k = torch.cat([1000 + 100 * g + rows for g in range(2)])[:, None].expand(-1, hidden)
    v = torch.cat([2000 + 100 * g + rows for g in range(2)])[:, None].expand(-1, hidden)
    for name, t in (("q", q), ("k", k), ("v", v)):
        state[f"model.layers.0.self_attn.{name}_proj.weight"] = t.contiguous()
    fused = hf_to_megatron(state, config)["decoder.layers.0.self_attention.linear_qkv.weight"]
    expected = torch.cat(
        [
            rows + 0, rows + 100, rows + 1000, rows + 2000,  # group 0: heads 0, 1, k0, v0
            rows + 200, rows + 300, rows + 1100, rows + 2100,  # group 1: heads 2, 3, k1, v1
        ]
    )  # fmt: skip
    assert torch.equal(fused[:, 0], expected) and torch.equal(fused[:, -1], expected)


def test_qwen2_qkv_bias_uses_the_same_group_layout_as_the_weight():
    config = tiny_config("qwen2")  # 4 heads, 2 groups, head_dim 8
    state = hf_state(tiny_hf_model("qwen2"))
    state["model.layers.1.self_attn.q_proj.bias"] = torch.arange(32.0)
    state["model.layers.1.self_attn.k_proj.bias"] = 100 + torch.arange(16.0)
    state["model.layers.1.self_attn.v_proj.bias"] = 200 + torch.arange(16.0)
    bias = hf_to_megatron(state, config)["decoder.layers.1.self_attention.linear_qkv.bias"]
    r = torch.arange(8.0)
    expected = torch.cat([r, r + 8, r + 100, r + 200, r + 16, r + 24, r + 108, r + 208])
    assert torch.equal(bias, expected)


def test_fc1_stacks_gate_above_up():
    model = tiny_hf_model("qwen3")
    state = hf_state(model)
    fc1 = hf_to_megatron(state, model.config)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:48], state["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[48:], state["model.layers.0.mlp.up_proj.weight"])


def test_tied_models_drop_the_output_layer_and_accept_an_identical_lm_head():
    model = tiny_hf_model("qwen3")
    with_head = dict(model.state_dict())  # lm_head.weight listed, tied to the embedding
    assert "lm_head.weight" in with_head
    mg = hf_to_megatron(with_head, model.config)
    assert "output_layer.weight" not in mg
    assert (
        megatron_to_hf_named(
            "output_layer.weight", mg["embedding.word_embeddings.weight"], model.config
        )
        == []
    )
    with_head["lm_head.weight"] = with_head["lm_head.weight"] + 1
    with pytest.raises(
        ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"
    ):
        hf_to_megatron(with_head, model.config)


def test_a_value_models_score_head_takes_the_output_layers_place_and_comes_back_exactly():
    """PPO's value model: a one-label token-classification state dict (the transformer, `score`
    with its bias), tied config or not; no lm_head either way."""
    for arch in ("qwen3", "llama"):
        model = tiny_hf_model(arch)
        state = {k: v for k, v in hf_state(model).items() if k != "lm_head.weight"}
        state["score.weight"] = torch.randn(1, 32)
        state["score.bias"] = torch.randn(1)
        mg = hf_to_megatron(state, model.config, value_head=True)
        names = expected_megatron_names(model.config) - {"output_layer.weight"}
        assert set(mg) == names | {"output_layer.score.weight", "output_layer.score.bias"}
        back = megatron_to_hf(mg, model.config)
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state), arch
    with pytest.raises(ValueError, match=r"score\.weight has shape \(2, 32\).*num_labels=1"):
        hf_to_megatron({**state, "score.weight": torch.zeros(2, 32)}, model.config, value_head=True)


def test_unknown_missing_or_mis_sized_tensors_and_models_are_errors():
    model = tiny_hf_model("llama")
    state = hf_state(model)
    with pytest.raises(ValueError, match=r"no Megatron counterpart for llama: \['extra.weight'\]"):
        hf_to_megatron({**state, "extra.weight": torch.zeros(1)}, model.config)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"has no 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        hf_to_megatron(missing, model.config)
    short = {**state, "model.embed_tokens.weight": state["model.embed_tokens.weight"][:-1]}
    with pytest.raises(ValueError, match="has 258 rows but the config's vocab_size is 259"):
        hf_to_megatron(short, model.config)
    with pytest.raises(ValueError, match=r"unknown Megatron parameter 'decoder\.layers\.0\.foo'"):
        megatron_to_hf_named("decoder.layers.0.foo", torch.zeros(1), model.config)
    mistral = SimpleNamespace(model_type="mistral")
    with pytest.raises(ValueError, match="model_type 'mistral'; supported: qwen2, qwen3, llama"):
        hf_to_megatron(state, mistral)


# -- against a real megatron-core GPTModel --------------------------------------------------------


def _gpt_model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    heads = config.num_attention_heads
    qk_norm = config.model_type == "qwen3"
    rope = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    tc = TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=getattr(config, "head_dim", None) or config.hidden_size // heads,
        ffn_hidden_size=config.intermediate_size,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=config.model_type == "qwen2",
        qk_layernorm=qk_norm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    return GPTModel(
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(config.vocab_size, 128, 1),
        max_sequence_length=config.max_position_embeddings,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope),
    )


def _load_into_gpt_model(rank: int) -> dict[str, dict]:
    from megatron.core import parallel_state

    undo_shim = install_megatron_cpu_shim()  # keep the reference: dropping it undoes the shim
    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for arch in ARCHS:
        hf_model = tiny_hf_model(arch)
        converted = hf_to_megatron(hf_state(hf_model), hf_model.config)
        gpt = _gpt_model(hf_model.config).eval()
        own = {k: tuple(v.shape) for k, v in gpt.state_dict().items() if "_extra_state" not in k}
        missing, unexpected = gpt.load_state_dict(converted, strict=False)
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            positions = torch.arange(9).expand(2, -1)
            mg_logits = gpt(input_ids=ids, position_ids=positions, attention_mask=None)
            hf_logits = hf_model(input_ids=ids).logits
        results[arch] = {
            "own": own,
            "converted": {k: tuple(v.shape) for k, v in converted.items()},
            "missing": [k for k in missing if "_extra_state" not in k],
            "unexpected": list(unexpected),
            "max_diff": (mg_logits[..., :VOCAB] - hf_logits).abs().max().item(),
        }
    undo_shim()
    return results


@pytest.fixture(scope="module")
def gpt_results() -> dict[str, dict]:
    # A separate process: megatron's parallel state is global, and needs a process group.
    return run_distributed(_load_into_gpt_model, 1, timeout_s=240)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_real_gpt_model_loads_the_converted_weights_and_matches_hf_logits(gpt_results, arch):
    result = gpt_results[arch]
    assert result["converted"] == result["own"]  # same names and shapes as megatron-core's
    assert set(result["own"]) == expected_megatron_names(tiny_config(arch))
    assert result["missing"] == [] and result["unexpected"] == []
    assert result["max_diff"] < 1e-4, result["max_diff"]
