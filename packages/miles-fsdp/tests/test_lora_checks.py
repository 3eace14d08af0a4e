"""LoRA settings checked against the checkpoint when the run's config is built (`load_config`),
before anything starts: each bad value names its flag, the value and the fix."""

from __future__ import annotations

import json

import pytest

from miles.backends.fsdp_utils.arguments import FSDPArgs
from miles.config import load_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora_checks")
    dense = build_tiny_checkpoint(root / "dense")
    moe = build_tiny_checkpoint(root / "moe", architecture="qwen3_moe")
    wider = build_tiny_checkpoint(root / "wider", intermediate_size=96)
    return {"dense": dense, "moe": moe, "wider": wider, "root": root}


def _load(checkpoint, *flags: str) -> FSDPArgs:
    required = ["--hf-checkpoint", str(checkpoint), "--prompt-data", "train.jsonl"]
    backend = load_config([*required, "--rollout-batch-size", "4", *flags]).backend
    assert isinstance(backend, FSDPArgs)
    return backend


def _adapter(checkpoint, out, rank: int, **config) -> str:
    """A PEFT adapter of `checkpoint`'s model, as PeftModel.save_pretrained writes it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    config = {"target_modules": ["q_proj", "v_proj"], **config}
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, **config)
    get_peft_model(model, lora).save_pretrained(out)
    return str(out)


def test_good_settings_load(checkpoints):
    args = _load(checkpoints["dense"], "--lora-rank", "8", "--target-modules", "q_proj,o_proj")
    assert args.uses_lora and args.target_module_names() == ["q_proj", "o_proj"]
    args = _load(checkpoints["moe"], "--lora-rank", "8")  # all-linear: attention only
    assert args.target_module_names() == "all-linear"


def test_a_target_that_matches_no_layer_lists_the_linear_layers(checkpoints):
    with pytest.raises(
        ValueError,
        match=r"--target-modules qkv_proj matches no module of Qwen3ForCausalLM; its linear "
        r"layers are: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj",
    ):
        _load(checkpoints["dense"], "--lora-rank", "8", "--target-modules", "q_proj,qkv_proj")


def test_the_output_head_and_non_linear_modules_are_refused(checkpoints):
    with pytest.raises(ValueError, match=r"--target-modules lm_head: the output head is not"):
        _load(checkpoints["dense"], "--lora-rank", "8", "--target-modules", "lm_head")
    with pytest.raises(ValueError, match=r"--target-modules mlp is a Qwen3MLP, not a linear"):
        _load(checkpoints["dense"], "--lora-rank", "8", "--target-modules", "mlp")
    with pytest.raises(ValueError, match=r"--exclude-modules w1 matches no module"):
        _load(checkpoints["dense"], "--lora-rank", "8", "--exclude-modules", "w1")


def test_moe_experts_are_refused_naming_the_layers_that_can_be_adapted(checkpoints):
    with pytest.raises(
        ValueError,
        match=r"--target-modules experts: the MoE experts of Qwen3MoeForCausalLM are fused "
        r"weights \(Qwen3MoeExperts\), which PEFT cannot wrap.*k_proj, o_proj, q_proj, v_proj",
    ):
        _load(checkpoints["moe"], "--lora-rank", "8", "--target-modules", "q_proj,experts")


def test_a_start_adapter_of_another_rank_or_base_is_refused(checkpoints):
    root = checkpoints["root"]
    adapter = _adapter(checkpoints["dense"], root / "adapter_r4", rank=4)
    args = _load(checkpoints["dense"], "--lora-rank", "4", "--lora-adapter-path", adapter)
    assert args.lora_adapter_path == adapter
    with pytest.raises(ValueError, match=r"has rank r=4, but --lora-rank is 8; pass --lora-rank 4"):
        _load(checkpoints["dense"], "--lora-rank", "8", "--lora-adapter-path", adapter)
    wider = _adapter(
        checkpoints["wider"], root / "adapter_wider", rank=4, target_modules=["up_proj"]
    )
    with pytest.raises(ValueError, match=r"does not fit .*dense \(trained on another base\?"):
        _load(checkpoints["dense"], "--lora-rank", "4", "--lora-adapter-path", wider)


def test_a_start_adapter_that_is_not_a_plain_lora_directory_is_refused(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"--lora-adapter-path .*: no adapter_config.json"):
        _load(checkpoints["dense"], "--lora-rank", "4", "--lora-adapter-path", str(tmp_path))
    adapter = _adapter(checkpoints["dense"], tmp_path / "dora", rank=4, use_dora=True)
    with pytest.raises(ValueError, match=r"sets use_dora=True, which miles does not"):
        _load(checkpoints["dense"], "--lora-rank", "4", "--lora-adapter-path", adapter)
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    config["peft_type"] = "IA3"
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"is a IA3 adapter, not LoRA"):
        _load(checkpoints["dense"], "--lora-rank", "4", "--lora-adapter-path", adapter)


def test_lora_refuses_moving_the_reference(checkpoints):
    with pytest.raises(ValueError, match=r"--ref-update-interval \(2\) .* frozen base"):
        _load(
            checkpoints["dense"], "--lora-rank", "4", "--use-kl-loss", "--kl-loss-coef", "0.1",
            "--ref-update-interval", "2",
        )  # fmt: skip
