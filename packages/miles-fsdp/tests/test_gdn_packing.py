"""Packed documents through Gated DeltaNet hybrids (a tiny Qwen3.5): the recurrent state and the
short convolution restart at every boundary, so a packed row gives the log-probs and gradients of
the same documents one per row, and an FSDP train step on packed rows matches unpacked training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .distributed import run_distributed
from .test_actor import (
    capture_full_grads,
    full_params,
    local_shard,
    make_actor,
    make_args,
    make_batch,
    reference_training,
)

CPU = torch.device("cpu")
# Document 1 outgrows a 64-token chunk of the chunked delta rule; the others are short. Their tails
# differ, so state carried over from a previous document shows in every later position.
DOC_LENGTHS = (9, 70, 5, 13)


def tiny_qwen3_5_config():
    """Qwen3.5 text model: a GDN layer, then a full-attention layer; byte vocabulary."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=256, pad_token_id=256,
    )  # fmt: skip


def tiny_qwen3_5(dtype: torch.dtype, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_qwen3_5_config(), dtype=dtype, attn_implementation=attn_implementation
    )
    return model.eval()


def build_qwen3_5_checkpoint(path: Path) -> Path:
    from miles.backends.sglang_utils.tiny_checkpoint import build_byte_tokenizer

    model = tiny_qwen3_5(torch.float32)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


def _packed_documents():
    from miles.backends.training_utils.batching.packing import pack_sequences

    generator = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in DOC_LENGTHS]
    packed = pack_sequences(docs, [3] * len(docs), [[1, 1, 1]] * len(docs), pad_to_multiple=16)
    assert packed.num_pad_tokens > 0  # the padding is a segment of its own too
    return docs, packed


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_qwen3_5_log_probs_and_grads_equal_one_document_per_row(attn_implementation):
    from miles.backends.fsdp_utils.modeling import packed_logits

    model = tiny_qwen3_5(torch.float64, attn_implementation)
    docs, packed = _packed_documents()
    logits = packed_logits(model, packed, attn_implementation=attn_implementation, device=CPU)
    log_probs = logits.log_softmax(-1)  # (T, V)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))  # (T, V)
    weights = weights.double()
    weights[packed.cu_seqlens[-1] :] = 0  # the trailing padding predicts nothing
    (log_probs * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # Qwen3.5's RMSNorms (and eager's softmax) compute in float32 even in a float64 model, hence
    # float32-level tolerances; a state leaking across a boundary moves log-probs by ~1e-2.
    for i, tokens in enumerate(docs):
        start, end = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
        alone = model(input_ids=torch.tensor([tokens])).logits[0].log_softmax(-1)  # (L, V)
        torch.testing.assert_close(log_probs[start:end], alone, rtol=0, atol=1e-6)
        (alone * weights[start:end]).sum().backward()
    for name, p in model.named_parameters():
        error = (packed_grads[name] - p.grad).abs().max() / p.grad.abs().max()
        assert error < 1e-6, f"{name}: relative error {error:.2e}"


def test_without_boundaries_the_gdn_layers_leak_across_documents():
    """What the test above guards: restarting position ids alone keep the full-attention layer
    document-local (a block-diagonal mask), but not the GDN layer's state and convolution."""
    from miles.backends.fsdp_utils.modeling import packed_logits

    model = tiny_qwen3_5(torch.float64)
    _, packed = _packed_documents()
    with torch.no_grad():
        logits = packed_logits(model, packed, attn_implementation="sdpa", device=CPU)
        leaky = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits[0]
    first = slice(0, DOC_LENGTHS[0])
    torch.testing.assert_close(leaky[first], logits[first], rtol=0, atol=1e-12)
    second = slice(DOC_LENGTHS[0], DOC_LENGTHS[0] + DOC_LENGTHS[1])
    assert (leaky[second] - logits[second]).abs().max() > 1e-3


def test_boundary_aware_conv_and_delta_rule_restart_at_each_document():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    from miles.backends.fsdp_utils.gdn_packing import (
        _boundary_aware_chunk_rule,
        _boundary_aware_conv,
    )

    generator = torch.Generator().manual_seed(0)
    lengths = [3, 66, 1, 7]
    cu_seqlens = torch.tensor([0, 3, 69, 70, 77], dtype=torch.int32)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    x, weight = randn(1, 6, 77), randn(6, 4)  # (1, D, T), (D, K)
    conv = _boundary_aware_conv(qwen3_5.causal_conv1d_fn)
    got = conv(x, weight, None, activation="silu", cu_seq_lens_q=cu_seqlens)
    want = [qwen3_5.causal_conv1d_fn(p, weight, None, "silu") for p in x.split(lengths, -1)]
    torch.testing.assert_close(got, torch.cat(want, -1), rtol=0, atol=0)
    assert not torch.allclose(conv(x, weight, None, activation="silu"), got)

    q, k, v = randn(1, 77, 2, 8), randn(1, 77, 2, 8), randn(1, 77, 2, 8)  # (1, T, H, D)
    g, beta = -randn(1, 77, 2).abs(), randn(1, 77, 2).sigmoid()  # (1, T, H)
    rule = _boundary_aware_chunk_rule(qwen3_5.torch_chunk_gated_delta_rule)
    options = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
    out, states = rule(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, **options)
    splits = [t.split(lengths, 1) for t in (q, k, v, g, beta)]
    want = [
        qwen3_5.torch_chunk_gated_delta_rule(*qkv, g=g_i, beta=b_i, **options)
        for *qkv, g_i, b_i in zip(*splits, strict=True)
    ]
    torch.testing.assert_close(out, torch.cat([o for o, _ in want], 1), rtol=0, atol=0)
    torch.testing.assert_close(
        states, torch.cat([s for _, s in want]), rtol=0, atol=0
    )  # (N, H, K, V)
    assert not torch.allclose(rule(q, k, v, g=g, beta=beta, **options)[0], out)


# -- an FSDP train step on packed rows -------------------------------------------------------


def _train_step(rank: int, checkpoint: Path) -> dict:
    args = make_args(checkpoint, micro_batch_size=4)
    actor, _ = make_actor(rank, 2, args)
    captured = capture_full_grads(actor)
    batch = make_batch()
    metrics = actor.train(0, local_shard(batch, rank, 2))
    params = full_params(actor.engine.model)
    if rank != 0:
        return {}
    ref_grads, ref_norms, ref_params = reference_training(args, batch)
    return {
        "norms": [m["train/grad_norm"] for m in metrics], "ref_norms": ref_norms,
        "grads": captured, "ref_grads": ref_grads, "params": params, "ref_params": ref_params,
    }  # fmt: skip


def _max_rel_diff(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


def test_fsdp_train_step_on_packed_qwen3_5_equals_unpacked_training(tmp_path):
    checkpoint = build_qwen3_5_checkpoint(tmp_path / "qwen3_5")
    rank0 = run_distributed(_train_step, 2, checkpoint, timeout_s=300)[0]
    pairs = zip(rank0["grads"], rank0["ref_grads"], strict=True)
    grad_diffs = [_max_rel_diff(got, want) for got, want in pairs]  # one per optimizer step
    # A GDN state leaking across documents makes these ~1e-1 to 1e0. Float32 rounding alone, in
    # the gradients of the chunked delta rule's decay (A_log, dt_bias: exp of cumulative sums),
    # gave 4e-7 and 9e-5 on an AMD EPYC with AVX-512, and 1.9e-4 and 9e-5 with torch, MKL and
    # oneDNN held to AVX2 (ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
    # ONEDNN_MAX_CPU_ISA=AVX2: what CI's machine runs).
    assert max(grad_diffs) < 1e-3, grad_diffs
    torch.testing.assert_close(rank0["norms"], rank0["ref_norms"], rtol=1e-4, atol=0)
    assert _max_rel_diff(rank0["params"], rank0["ref_params"]) < 1e-4


def test_a_packed_gdn_moe_forward_measures_its_routers_over_the_packed_tokens():
    # A Gated DeltaNet hybrid runs packed rows as one sequence even on sdpa: the MoE metrics'
    # token order must be that one (it was the padded layout's, and the mask did not fit).
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    from miles.backends.fsdp_utils.modeling import packed_logits, runs_as_one_row
    from miles.backends.fsdp_utils.moe_stats import MoEStats
    from miles.backends.fsdp_utils.routing import real_tokens

    config = Qwen3_5MoeTextConfig(
        vocab_size=259, hidden_size=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=256, pad_token_id=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    _, packed = _packed_documents()
    assert runs_as_one_row(model, "sdpa")
    real = real_tokens(packed, runs_as_one_row(model, "sdpa"))
    assert real.shape == (packed.total_length,) and int(real.sum()) == sum(DOC_LENGTHS)
    moe: dict = {}
    with torch.no_grad(), MoEStats(model, 0.001).measuring(real, into=moe):
        packed_logits(model, packed, attn_implementation="sdpa", device=CPU)
    assert "aux_loss" in moe and any(key.startswith("moe/") for key in moe)
