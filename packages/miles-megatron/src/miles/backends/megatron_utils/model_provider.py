"""Build a Megatron-core GPTModel for a Hugging Face Qwen2 / Qwen3 / Llama config and load its weights.

The model uses Megatron's *local* layer spec (plain PyTorch modules, no Transformer Engine), so it
needs only megatron-core. What the config maps to: RMSNorm, SwiGLU MLP, grouped-query attention
with RoPE applied by GPTModel, q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), tied or untied
output layer. Anything else the HF config asks for (other activations, RoPE scalings Megatron
cannot reproduce) raises instead of building a model that silently computes something else.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from miles.backends.megatron_utils.arguments import (
    MegatronArgs,
    padded_vocab_size,
    validate_against_hf,
)
from miles.backends.megatron_utils.context_parallel import ContextParallelAttention
from miles.backends.megatron_utils.convert import attention_dims, hf_to_megatron
from miles.backends.megatron_utils.tp_sharding import tp_shard
from miles.backends.megatron_utils.value_model import GPTValueModel, value_head_has_bias
from miles.backends.training_utils.infra.device import get_device_info

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Megatron's Llama 3 RoPE scaling hard-codes these (megatron.core RotaryEmbedding._apply_scaling);
# a checkpoint with other values would silently get different frequencies.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def require_gpu() -> None:
    """Refuse to start the backend on a machine without NVIDIA or AMD GPUs (one-line error)."""
    kind = get_device_info().kind
    if kind not in ("cuda", "rocm"):
        raise RuntimeError(
            f"the megatron backend needs NVIDIA or AMD GPUs (found: {kind}); "
            "use --train-backend fsdp on this machine"
        )


def transformer_config_from_hf(hf_config: Any, args: MegatronArgs) -> TransformerConfig:
    """Megatron's TransformerConfig for the decoder stack of `hf_config`, parallelised by `args`.

    Raises ValueError for a model the local spec cannot reproduce exactly (see the module
    docstring) or sizes the parallel axes cannot split.
    """
    # World size = one model-parallel group: the data-parallel checks belong to the actor.
    validate_against_hf(args, hf_config, args.model_parallel_size)
    _check_architecture(hf_config)
    _rope(hf_config)  # refuse an unsupported RoPE here, where the actor first reads the config
    if args.sequence_parallel:
        # megatron.core's WrappedTorchNorm asserts this deep inside model construction.
        raise ValueError(
            "--sequence-parallel needs Transformer Engine's (or Apex's) layer norms, and the "
            "Megatron backend builds models with megatron-core's local layer spec, whose torch "
            "RMSNorm does not support it; drop --sequence-parallel"
        )
    heads, kv_heads, head_dim = attention_dims(hf_config)
    dtype = _DTYPES[args.params_dtype]
    model_type = hf_config.model_type
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: fc1 holds [gate; up], silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type == "qwen3",
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # Micro-batches are padded to their own longest sample (and dynamic batching varies their
        # rows), so pipeline stages exchange each activation's shape before the activation.
        variable_seq_lengths=args.pipeline_model_parallel_size > 1,
        # Unused by dense models, but megatron refuses variable lengths with its default (allgather).
        moe_token_dispatcher_type="alltoall",
        bf16=dtype == torch.bfloat16,
        recompute_granularity="selective" if args.recompute_activations else None,
    )


def build_gpt_model(
    hf_config: Any,
    args: MegatronArgs,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    value_head: bool = False,
) -> GPTModel:
    """A randomly initialised GPTModel shaped like `hf_config`, holding this rank's tensor-parallel
    slices (Megatron's parallel state must be initialised). `pre_process` / `post_process`: this
    pipeline stage holds the embedding / the final norm and output layer.

    Its forward is `model(input_ids, position_ids, attention_mask=None)` (causal attention; the
    ids are [B, T]) and returns vocabulary-parallel logits [B, T, padded_vocab / tp], or with
    `value_head` (PPO's value model, a `GPTValueModel`) values [B, T, 1].
    """
    config = transformer_config_from_hf(hf_config, args)
    rope_theta, rope_scaling_factor = _rope(hf_config)
    gpt_model_args = dict(
        config=config,
        transformer_layer_spec=_layer_spec(config),
        vocab_size=padded_vocab_size(
            hf_config.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        ),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        rotary_base=rope_theta,
        rope_scaling=rope_scaling_factor is not None,
        rope_scaling_factor=rope_scaling_factor or 8.0,
    )
    if value_head:
        return GPTValueModel(**gpt_model_args, value_head_bias=value_head_has_bias(hf_config))
    return GPTModel(
        **gpt_model_args,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )


def _layer_spec(config: TransformerConfig) -> ModuleSpec:
    """Megatron's local layer spec; with context parallelism its core attention (which refuses
    cp > 1) is replaced by ours, which gathers keys and values over the context-parallel group."""
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if config.context_parallel_size > 1:
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec


def load_hf_weights(
    model: torch.nn.Module,
    hf_state: dict[str, torch.Tensor],
    hf_config: Any,
    args: MegatronArgs,
    *,
    value_head: bool = False,
) -> None:
    """Copy a full HF state dict into `model` (from `build_gpt_model`): convert to Megatron's
    layout, keep this rank's tensor-parallel slice of each parameter, and load strictly, so a
    missing or unexpected tensor raises. Pipeline stages take their own layers. `value_head`:
    `model` is a value model and `hf_state` a one-label token-classification model's."""
    tp_size = mpu.get_tensor_model_parallel_world_size()
    if tp_size != args.tensor_model_parallel_size:
        raise ValueError(
            f"--tensor-model-parallel-size is {args.tensor_model_parallel_size}, but Megatron's "
            f"parallel state has {tp_size} tensor-parallel ranks; initialise it from the same args"
        )
    tp_rank = mpu.get_tensor_model_parallel_rank()
    full = hf_to_megatron(
        hf_state, hf_config, vocab_divisible_by=args.make_vocab_size_divisible_by,
        tp_size=tp_size, value_head=value_head,
    )  # fmt: skip
    global_names = global_layer_names(model)
    local_state = {}
    for name, current in model.state_dict().items():
        if name.endswith("._extra_state"):
            local_state[name] = current  # local-spec modules keep no extra state (None)
            continue
        source = global_names(name)
        if source == "output_layer.weight" and hf_config.tie_word_embeddings:
            # The last pipeline stage keeps its own copy of the tied embedding.
            source = "embedding.word_embeddings.weight"
        if source not in full:
            raise ValueError(
                f"the model has {name} but the converted HF checkpoint has no {source}; the "
                "model and checkpoint were built from different configs"
            )
        local_state[name] = tp_shard(source, full[source], tp_rank, tp_size, hf_config)
    model.load_state_dict(local_state, strict=True)
    logger.info(
        "loaded %d HF tensors into tensor-parallel rank %d of %d", len(hf_state), tp_rank, tp_size
    )


def global_layer_names(model: torch.nn.Module):
    """Maps a local state-dict name (`decoder.layers.<local>.`) to the converter's global name:
    a pipeline stage numbers its layers from 0, Megatron's `layer_number` is global and 1-based."""
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", [])
    offsets = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(layers)}

    def rename(name: str) -> str:
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = offsets[parts[2]]
        return ".".join(parts)

    return rename


def _check_architecture(hf_config: Any) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"this {hf_config.model_type} config uses hidden_act={act!r}; the Megatron backend "
            "maps only SwiGLU (silu); use the FSDP backend for this model"
        )


def _rope(hf_config: Any) -> tuple[float, float | None]:
    """(rope theta, Llama 3 scaling factor or None) of `hf_config`; transformers 5 keeps both in
    `rope_parameters`, 4.x in `rope_theta` and `rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3" and all(
        float(params.get(k, -1)) == v for k, v in _MEGATRON_LLAMA3_ROPE.items()
    ):
        return theta, float(params["factor"])
    raise ValueError(
        f"this {hf_config.model_type} config uses RoPE scaling {params}; the Megatron backend "
        f"supports default RoPE and Llama 3 scaling with {_MEGATRON_LLAMA3_ROPE}; use the FSDP "
        "backend for this model"
    )
