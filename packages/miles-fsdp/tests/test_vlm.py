"""A tiny Qwen2.5-VL on the FSDP backend, 2 gloo ranks, image samples beside text ones: a train
step's gradients equal an unpacked single-process Hugging Face reference, resume is exact, the HF
export round-trips under the hub's names, weight sync speaks them too, and
--freeze-vision-tower trains the language model alone."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

import torch

from miles.backends.fsdp_utils.vision import RESPONSE_IMAGE_STAND_IN
from miles.backends.sglang_utils.tiny_vlm import IMAGE_PAD_ID

from .distributed import run_distributed
from .test_actor import (
    SAMPLES,
    _max_rel_diff,
    capture_full_grads,
    full_params,
    local_shard,
    make_actor,
    make_args,
    reference_training,
)

COLOURS = ("red", "green", "blue", "yellow")


def build_vlm(path: Path, architecture: str = "qwen2_5_vl") -> Path:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(path, architecture=architecture, seed=0)


def image_data(rng: random.Random) -> str:
    from PIL import Image, ImageDraw

    size = (rng.choice((56, 84, 112)), rng.choice((56, 84)))  # grids of several shapes
    image = Image.new("RGB", size, "white")
    x, y = rng.randrange(size[0] - 20), rng.randrange(size[1] - 20)
    ImageDraw.Draw(image).ellipse((x, y, x + 20, y + 20), fill=rng.choice(COLOURS))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def make_image_batch(checkpoint: Path, seed: int = 0) -> dict[str, list]:
    """SAMPLES documents: prompts with one or two images (and every fourth text-only) through the
    model's processor, random responses, some response tokens masked out."""
    from transformers import AutoProcessor

    from miles.backends.sglang_utils.image_data import decode_image

    processor = AutoProcessor.from_pretrained(checkpoint)
    rng = random.Random(seed)
    batch: dict[str, list] = {k: [] for k in ("tokens", "response_lengths", "total_lengths")}
    batch.update(loss_mask=[], rewards=[], images=[])
    for row in range(SAMPLES):
        images = [] if row % 4 == 3 else [image_data(rng) for _ in range(rng.choice((1, 2)))]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"q{row}?"}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        pixels = [decode_image(i) for i in images] or None
        prompt = processor(text=[text], images=pixels)["input_ids"][0]
        response = rng.randint(2, 6)
        mask = [1] * response
        mask[rng.randrange(response)] = rng.choice([0, 1])
        answer = [rng.randrange(256) for _ in range(response)]
        if row == 1:  # a model may sample the image token as text: it must train as text
            answer[0] = IMAGE_PAD_ID
        batch["tokens"].append([*prompt, *answer])
        batch["response_lengths"].append(response)
        batch["total_lengths"].append(len(batch["tokens"][-1]))
        batch["loss_mask"].append(mask)
        batch["rewards"].append(rng.uniform(-1, 1))
        batch["images"].append(images)
    return batch


def vlm_log_probs(processor, batch: dict, temperature: float):
    """`log_probs_of(model, row)` for the reference: one unpacked forward of a row with the
    processor's pixel inputs, as a user of transformers would run it."""
    from miles.backends.sglang_utils.image_data import decode_image
    from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy

    def log_probs_of(model, row):
        tokens, images = batch["tokens"][row], batch["images"][row]
        ids = torch.tensor([tokens])
        response = batch["response_lengths"][row]
        # What the trainer runs: an image token written in the response enters as its stand-in.
        inputs = {"input_ids": ids.clone()}
        written = inputs["input_ids"][0, -response:]
        written[written == IMAGE_PAD_ID] = RESPONSE_IMAGE_STAND_IN
        if images:
            pixels = processor.image_processor(
                images=[decode_image(i) for i in images], return_tensors="pt"
            )
            image_tokens = inputs["input_ids"] == model.config.image_token_id
            inputs.update(pixels, mm_token_type_ids=image_tokens.int())
        logits = model(**inputs).logits[0]
        end = len(tokens) - 1
        positions = torch.arange(end - response, end)
        return get_log_probs_and_entropy(
            logits[positions], ids[0, positions + 1], temperature=temperature
        )

    return log_probs_of


def hub_names(checkpoint: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", "pt") as weights:
        return set(weights.keys())


def reference_of(args, checkpoint: Path, batch: dict):
    """`reference_training` with the checkpoint as a plain transformers VLM."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    ref_model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    temperature = args.spec.rollout_temperature
    log_probs_of = vlm_log_probs(AutoProcessor.from_pretrained(checkpoint), batch, temperature)
    return reference_training(args, batch, model=ref_model, log_probs_of=log_probs_of)


def _one_step_of(rank: int, checkpoint: Path) -> dict:
    """Another architecture's first step against its reference, and its weight-sync names."""
    batch = make_image_batch(checkpoint)
    args = make_args(checkpoint, use_dynamic_batch_size=True, max_tokens_per_gpu=160)
    actor, _ = make_actor(rank, 2, args)
    captured = capture_full_grads(actor)
    steps = actor.train(0, local_shard(batch, rank, 2))
    synced = {name for name, _ in actor.engine.named_weights()}
    if rank != 0:
        return {}
    ref_grads, ref_norms, _ = reference_of(args, checkpoint, batch)
    return {
        "norms": [m["train/grad_norm"] for m in steps], "ref_norms": ref_norms,
        "grad_diff": [_max_rel_diff(c, r) for c, r in zip(captured, ref_grads, strict=True)],
        "synced_names_are_hub_names": synced <= hub_names(checkpoint),
    }  # fmt: skip


def _vlm_life_cycle(
    rank: int, checkpoint: Path, save_dir: Path, export_dir: Path, qwen3_vl: Path
) -> dict:
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    batch = make_image_batch(checkpoint)
    # Dynamic micro-batches: several documents (and their images) per forward.
    args = make_args(checkpoint, use_dynamic_batch_size=True, max_tokens_per_gpu=160)
    args = args.with_paths(save=str(save_dir))
    actor, _ = make_actor(rank, 2, args)
    captured = capture_full_grads(actor)
    steps = actor.train(0, local_shard(batch, rank, 2))
    step_grads = list(captured)  # the hook goes on capturing the later steps
    trained = full_params(actor.engine.model)
    synced = {name: tensor.shape for name, tensor in actor.engine.named_weights()}
    actor.save_model(0)
    next_steps = actor.train(1, local_shard(batch, rank, 2))
    resumed, resumed_start = make_actor(rank, 2, args.with_paths(load=str(save_dir)))
    resumed_steps = resumed.train(1, local_shard(batch, rank, 2))
    resumed.export_hf(export_dir)
    final = full_params(resumed.engine.model)

    frozen_args = make_args(checkpoint, freeze_vision_tower=True)
    frozen, _ = make_actor(rank, 2, frozen_args)
    before = full_params(frozen.engine.model)
    frozen.train(0, local_shard(batch, rank, 2))
    after = full_params(frozen.engine.model)
    frozen_moved = {
        part: any(not torch.equal(before[n], after[n]) for n in before if (".visual." in n) == vis)
        for part, vis in (("vision", True), ("language", False))
    }
    qwen3_vl_step = _one_step_of(rank, qwen3_vl)
    result = {"resumed_start": resumed_start, "frozen_moved": frozen_moved,
              "next_losses": [s["train/loss"] for s in next_steps],
              "resumed_losses": [s["train/loss"] for s in resumed_steps]}  # fmt: skip
    if rank != 0:
        return result
    hub = hub_names(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(export_dir, dtype=torch.float32)
    exported = {n: p.detach() for n, p in model.named_parameters()}
    with safe_open(export_dir / "model.safetensors", "pt") as weights:
        export_names = set(weights.keys())
    ref_grads, ref_norms, ref_params = reference_of(args, checkpoint, batch)
    return {
        **result,
        "qwen3_vl": qwen3_vl_step,
        "norms": [m["train/grad_norm"] for m in steps], "ref_norms": ref_norms,
        "grad_diff": [_max_rel_diff(c, r) for c, r in zip(step_grads, ref_grads, strict=True)],
        "param_diff": _max_rel_diff(trained, ref_params),
        "synced_names_are_hub_names": set(synced) <= hub and len(synced) == len(hub),
        "export_names_are_hub_names": export_names == hub,
        "export_matches": exported.keys() == final.keys()
        and all(torch.equal(final[n], exported[n]) for n in exported),
    }  # fmt: skip


def test_a_tiny_vlm_trains_like_the_unpacked_reference_resumes_exports_and_freezes(tmp_path):
    checkpoint = build_vlm(tmp_path / "vlm")
    qwen3_vl = build_vlm(tmp_path / "qwen3_vl", "qwen3_vl")
    results = run_distributed(
        _vlm_life_cycle, 2, checkpoint, tmp_path / "save", tmp_path / "export", qwen3_vl,
        timeout_s=300,
    )  # fmt: skip
    rank0 = results[0]
    # Packed, sharded over two ranks, several images per micro-batch: the same gradients and
    # steps as transformers' own forward of one document at a time (float32 rounding).
    torch.testing.assert_close(rank0["norms"], rank0["ref_norms"], rtol=1e-4, atol=0)
    assert max(rank0["grad_diff"]) < 1e-4, rank0["grad_diff"]
    # Two AdamW steps on: Adam divides each gradient entry by its own running magnitude, so the
    # rounding of entries near zero reaches the update undamped.
    assert rank0["param_diff"] < 1e-3, rank0["param_diff"]
    assert rank0["synced_names_are_hub_names"], "weight sync must use the checkpoint's names"
    assert rank0["export_names_are_hub_names"] and rank0["export_matches"]
    # Qwen3-VL (its deepstack features feed the language model's first layers) alike.
    qwen3 = rank0["qwen3_vl"]
    torch.testing.assert_close(qwen3["norms"], qwen3["ref_norms"], rtol=1e-4, atol=0)
    assert max(qwen3["grad_diff"]) < 1e-4, qwen3["grad_diff"]
    assert qwen3["synced_names_are_hub_names"]
    for result in results:
        assert result["resumed_start"] == 1
        assert result["resumed_losses"] == result["next_losses"]
        assert result["frozen_moved"] == {"vision": False, "language": True}


def test_vlm_settings_the_backends_cannot_honour_are_refused_before_start_up(tmp_path):
    import pytest

    from miles.backends.fsdp_utils.arguments import FSDPArgs
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    vlm = build_vlm(tmp_path / "vlm")
    text = build_tiny_checkpoint(tmp_path / "text")
    with pytest.raises(ValueError, match=r"\(qwen3\) has no vision tower; drop the flag"):
        FSDPArgs(freeze_vision_tower=True).check_checkpoint(str(text))
    FSDPArgs(freeze_vision_tower=True).check_checkpoint(str(vlm))
    with pytest.raises(ValueError, match="LoRA on a vision-language model"):
        FSDPArgs(lora_rank=4).check_checkpoint(str(vlm))
