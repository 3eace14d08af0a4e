"""LoRA on the FSDP backend, on 2 gloo ranks: only the adapters train (the base stays bit-identical
and alone has no optimizer state), the KL reference is the base itself, resume is exact, the
merged weights the engines get are PEFT's merge, and both exports load where users load them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from .distributed import run_distributed
from .test_actor import (
    SAMPLES,
    build_checkpoint,
    local_shard,
    make_actor,
    make_args,
    make_batch,
    sample_log_probs,
)

TEMPERATURE = 0.8  # make_args' rollout temperature
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().full_tensor().clone() if hasattr(tensor, "full_tensor") else tensor


def _lora_life(rank: int, checkpoint: Path, save_dir: Path, export_dir: Path) -> dict:
    from miles.backends.fsdp_utils.lora import lora_layers

    args = make_args(
        checkpoint, loss={"use_kl_loss": True, "kl_loss_coef": 0.1}, **LORA
    ).with_paths(save=str(save_dir))
    actor, _ = make_actor(rank, 2, args, with_ref=True)
    engine = actor.engine
    model = engine.model
    base = {n: _full(p) for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    named = {id(p): n for n, p in model.named_parameters()}

    batch = make_batch(SAMPLES)
    shard = local_shard(batch, rank, 2)
    actor.train(0, shard)
    actor.save_model(0)
    actor.export_hf(export_dir)  # in the run: the merged model
    after_base = {n: _full(p) for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}
    policy = [lp.tolist() for lp in actor.trainer.log_probs(shard)]
    reference = [lp.tolist() for lp in actor.trainer.log_probs(shard, reference=True)]
    merged = {name: tensor.clone() for name, tensor in engine.named_weights()}
    adapter_names = [name for name, _ in engine.adapter_weights()]
    continued = actor.train(1, shard)

    resumed, start = make_actor(rank, 2, args.with_paths(load=str(save_dir)), with_ref=True)
    resumed_steps = resumed.train(1, shard)
    return {
        "trainable": sorted(trainable),
        "optimized": sorted(named[i] for i in optimized),
        "optimizer_state": sorted(named[id(p)] for p in engine.optimizer.state),
        "base_identical": base.keys() == after_base.keys()
        and all(torch.equal(base[n], after_base[n]) for n in base),
        "adapters": adapters,
        "policy": policy,
        "reference": reference,
        "merged": merged,
        "adapted_layers": [name for name, _ in lora_layers(model)],
        "adapter_names": adapter_names,
        "adapter_config": engine.adapter_config(),
        "continued": continued,
        "resumed_start": start,
        "resumed": resumed_steps,
        # GRPO groups share their prompt: one forward of it per micro-batch, adapters or not.
        "shares_prompts": id(model) in engine.sharing_models,
    }


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    checkpoint = build_checkpoint(root / "ckpt")
    results = run_distributed(
        _lora_life, 2, checkpoint, root / "save", root / "export", timeout_s=300
    )
    return checkpoint, root, results


def test_only_the_adapters_train_and_the_base_stays_bit_identical(lora_run):
    _, _, results = lora_run
    for rank, result in enumerate(results):
        assert result["trainable"], "LoRA added adapter parameters"
        assert all(".lora_A." in n or ".lora_B." in n for n in result["trainable"])
        assert result["optimized"] == result["trainable"], f"rank {rank}: optimizer params"
        assert result["optimizer_state"] == result["trainable"], f"rank {rank}: Adam state"
        assert result["base_identical"], f"rank {rank}: training moved a frozen base weight"
        assert result["shares_prompts"], f"rank {rank}: LoRA turned prompt sharing off"
        lora_b = [t for n, t in result["adapters"].items() if ".lora_B." in n]
        assert any(t.abs().max() > 0 for t in lora_b), "B starts at zero and must have trained"


def test_the_reference_is_the_base_with_adapters_off(lora_run):
    """The disabled-adapter reference gives a separately loaded base's log-probs, so the KL
    against it is the KL against that base; the policy's differ (the adapters trained)."""
    from transformers import AutoModelForCausalLM

    from miles.backends.training_utils.algorithms.formulas.kl import compute_approx_kl

    checkpoint, _, results = lora_run
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    batch = make_batch(SAMPLES)
    for rank, result in enumerate(results):
        shard = local_shard(batch, rank, 2)
        with torch.no_grad():
            want = [
                sample_log_probs(base, tokens, length, TEMPERATURE)[0]
                for tokens, length in zip(shard["tokens"], shard["response_lengths"], strict=True)
            ]
        for got, ref, pol in zip(result["reference"], want, result["policy"], strict=True):
            got, pol = (
                torch.tensor(got, dtype=torch.float64),
                torch.tensor(pol, dtype=torch.float64),
            )
            ref = ref.double()
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
            assert not torch.allclose(pol, got, atol=1e-4), "the policy equals the base"
            kl_shared = compute_approx_kl(pol, got, kl_type="k3")
            kl_separate = compute_approx_kl(pol, ref, kl_type="k3")
            torch.testing.assert_close(kl_shared, kl_separate, atol=1e-5, rtol=0)


def test_resume_is_exact(lora_run):
    _, _, results = lora_run
    for result in results:
        assert result["resumed_start"] == 1
        assert result["resumed"] == result["continued"], "resumed steps differ from the run's"


def test_merged_sync_sends_peft_merge_of_the_adapted_layers_only(lora_run):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    checkpoint, _, results = lora_run
    result = results[0]
    assert results[1]["merged"].keys() == result["merged"].keys()
    assert sorted(result["merged"]) == sorted(f"{n}.weight" for n in result["adapted_layers"])
    # PEFT's own merge of the trained adapters onto the checkpoint.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig.from_peft_type(**result["adapter_config"]))
    state = {n.replace(".default", ""): t for n, t in result["adapters"].items()}
    for name, param in peft_model.base_model.model.named_parameters():
        if name.replace(".default", "") in state:
            param.data.copy_(state[name.replace(".default", "")])
    merged = dict(peft_model.merge_and_unload().named_parameters())
    for name, tensor in result["merged"].items():
        torch.testing.assert_close(tensor, merged[name].detach(), atol=1e-6, rtol=1e-6)
    names = result["adapter_names"]
    assert names and all(n.startswith("base_model.model.model.layers.") for n in names)


def test_every_export_gives_the_trainers_log_probs(lora_run, tmp_path):
    """The PEFT adapter (offline --adapter-only) on the base, the merged model (offline), and the
    merged model exported in the run."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.checkpoint import export_checkpoint_to_hf

    checkpoint, root, results = lora_run
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    export_checkpoint_to_hf(root / "save", adapter_dir, adapter_only=True)
    assert {p.name for p in adapter_dir.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    export_checkpoint_to_hf(root / "save", merged_dir)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float64).eval()
    in_run = AutoModelForCausalLM.from_pretrained(root / "export", dtype=torch.float64).eval()
    batch = make_batch(SAMPLES)
    for rank, result in enumerate(results):
        shard = local_shard(batch, rank, 2)
        # The trainer's policy log-probs were taken right after the saved rollout.
        for tokens, length, got in zip(
            shard["tokens"], shard["response_lengths"], result["policy"], strict=True
        ):
            with torch.no_grad():
                adapted = sample_log_probs(peft_model, tokens, length, TEMPERATURE)[0]
                whole = sample_log_probs(merged, tokens, length, TEMPERATURE)[0]
                exported = sample_log_probs(in_run, tokens, length, TEMPERATURE)[0]
            got = torch.tensor(got, dtype=torch.float64)
            for model_log_probs in (adapted, whole, exported):
                torch.testing.assert_close(model_log_probs.double(), got, atol=1e-5, rtol=0)


def test_export_adapter_only_of_a_full_fine_tuning_checkpoint_is_refused(lora_run, tmp_path):
    from miles.backends.fsdp_utils.checkpoint import META_FILE, export_checkpoint_to_hf
    from miles.utils.checkpoint_layout import MANIFEST_FILE, iteration_dir

    _, root, _ = lora_run
    copy = tmp_path / "full"
    shutil.copytree(root / "save", copy)
    meta_path = iteration_dir(copy, 0) / META_FILE
    meta = json.loads(meta_path.read_text())
    del meta["extra"]["lora_config"]
    meta_path.write_text(json.dumps(meta))
    # Its manifest would rightly call the edited meta.json rewritten: the checkpoint stands for
    # one an older miles wrote (no manifest), which loads with a warning.
    (iteration_dir(copy, 0) / MANIFEST_FILE).unlink()
    with pytest.raises(ValueError, match="drop --adapter-only"):
        export_checkpoint_to_hf(copy, tmp_path / "out", adapter_only=True)
