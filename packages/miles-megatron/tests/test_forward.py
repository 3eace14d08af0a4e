"""The actor's micro-batch path through Megatron's own schedule, on 2 gloo processes with tp=2.

Log-probs of the response tokens of right-padded samples of different lengths equal the HF
model's; a training micro-step gives a finite loss and gradients on every rank. Also: the actor
refuses a machine without GPUs, and `miles train --train-backend megatron` exposes its flags.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from miles.backends.megatron_utils.arguments import MegatronArgs
from miles.backends.megatron_utils.forward import pad_micro_batch
from miles.backends.training_utils.logprobs import get_log_probs_and_entropy
from miles.backends.training_utils.loss_config import LossConfig

from .cpu_shim import TorchWithoutCuda, install_megatron_cpu_shim, run_distributed

ARGS = {"tensor_model_parallel_size": 2, "params_dtype": "float32",
        "make_vocab_size_divisible_by": 8, "seed": 0}  # fmt: skip
CONFIG = transformers.Qwen3Config(
    vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    tie_word_embeddings=True,
)  # fmt: skip
SAMPLES = [list(range(3, 14)), list(range(40, 47))]  # two documents of different lengths
RESPONSE_LENGTHS = [4, 3]
TEMPERATURE = 0.7


def micro_batch() -> dict:
    return {
        "tokens": SAMPLES,
        "response_lengths": RESPONSE_LENGTHS,
        "total_lengths": [len(t) for t in SAMPLES],
        "loss_masks": [[1] * r for r in RESPONSE_LENGTHS],
        "advantages": [[0.5] * RESPONSE_LENGTHS[0], [-1.0] * RESPONSE_LENGTHS[1]],
    }


def hf_log_probs(state: dict) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32)
    model.load_state_dict(state)
    out = []
    for tokens, r in zip(SAMPLES, RESPONSE_LENGTHS, strict=True):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]  # (L, V)
        lp, _ = get_log_probs_and_entropy(
            logits[len(tokens) - r - 1 : -1], ids[0, len(tokens) - r :], temperature=TEMPERATURE
        )
        out.append(lp)
    return out


def _worker(rank: int, state: dict) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    from miles.backends.megatron_utils.forward import MicroBatchForward
    from miles.backends.megatron_utils.model_provider import build_gpt_model, load_hf_weights
    from miles.backends.megatron_utils.parallel import (
        destroy_megatron_parallel,
        initialize_megatron_parallel,
    )
    from miles.backends.training_utils.loss import LossNormalizer

    keep = install_megatron_cpu_shim()  # noqa: F841 (the patches live as long as this)
    schedules.torch = TorchWithoutCuda()
    args = MegatronArgs(**ARGS)
    initialize_megatron_parallel(args)
    model = build_gpt_model(CONFIG, args)
    load_hf_weights(model, state, CONFIG, args)
    forward = MicroBatchForward(
        hf_config=CONFIG, temperature=TEMPERATURE, device=torch.device("cpu")
    )
    schedule = get_forward_backward_func()

    def run(collect: str, **kwargs):
        micro = micro_batch()
        if collect == "loss":
            micro["log_probs"] = [torch.zeros(r) for r in RESPONSE_LENGTHS]
        return schedule(
            forward_step_func=forward.step_func(
                LossConfig(), collect=collect, num_micro_batches=1,
                forward_only=kwargs["forward_only"], normalizer=kwargs.get("normalizer"),
            ),
            data_iterator=iter([micro]), model=[model], num_microbatches=1,
            seq_length=max(len(t) for t in SAMPLES), micro_batch_size=2,
            forward_only=kwargs["forward_only"],
        )  # fmt: skip

    log_probs = run("log_probs", forward_only=True)[0]["log_probs"]
    normalizer = LossNormalizer(num_samples=2, num_tokens=sum(RESPONSE_LENGTHS), dp_size=1)
    metrics = run("loss", forward_only=False, normalizer=normalizer)[0]["metrics"]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    result = {
        "log_probs": log_probs,
        "pg_loss": float(metrics["pg_loss"][0]),
        "grad_finite": all(bool(torch.isfinite(g).all()) for g in grads),
        "num_grads": len(grads),
    }
    destroy_megatron_parallel()
    return result


@pytest.fixture(scope="module")
def results():
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32).state_dict()
    return state, run_distributed(_worker, 2, state, timeout_s=240)


def test_response_log_probs_of_padded_samples_equal_the_hf_models(results):
    state, per_rank = results
    expected = hf_log_probs(state)
    for rank_result in per_rank:
        for ours, theirs in zip(rank_result["log_probs"], expected, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)


def test_a_training_micro_step_gives_finite_gradients_on_every_rank(results):
    _, per_rank = results
    for rank_result in per_rank:
        assert rank_result["grad_finite"] and rank_result["num_grads"] > 0
    assert per_rank[0]["pg_loss"] == pytest.approx(per_rank[1]["pg_loss"])


def test_pad_micro_batch_points_each_response_token_at_its_predicting_position():
    input_ids, position_ids, positions, targets = pad_micro_batch(micro_batch())
    assert input_ids.shape == (2, 11) and position_ids[1].tolist() == list(range(11))
    assert input_ids[1, 7:].eq(0).all()  # right padding after the shorter document
    assert positions[0].tolist() == [6, 7, 8, 9] and targets[0].tolist() == SAMPLES[0][7:]
    assert positions[1].tolist() == [3, 4, 5] and targets[1].tolist() == SAMPLES[1][4:]


def test_the_actor_refuses_a_machine_without_gpus(tmp_path):
    from types import SimpleNamespace

    from miles.backends.megatron_utils.actor import MegatronTrainRayActor

    actor = MegatronTrainRayActor(0, 1, "127.0.0.1", 29500)
    args = SimpleNamespace(megatron=MegatronArgs(), loss=LossConfig(), engine_urls=[])
    with pytest.raises(RuntimeError, match=r"needs NVIDIA or AMD GPUs.*--train-backend fsdp"):
        actor.init(args, "actor", with_ref=False)


def test_miles_train_takes_the_megatron_flags():
    from miles.config import load_config

    config = load_config([
        "--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "4",
        "--train-backend", "megatron", "--tensor-model-parallel-size", "2",
        "--actor-num-gpus-per-node", "2",
    ])  # fmt: skip
    assert isinstance(config.backend, MegatronArgs)
    assert config.backend.tensor_model_parallel_size == 2
    assert config.actor_args().megatron is config.backend


def test_the_rollout_is_split_per_model_replica_not_per_rank():
    from miles.config import load_config

    flags = ["--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "2",
             "--train-backend", "megatron", "--tensor-model-parallel-size", "2"]  # fmt: skip
    # 6 samples per step: divisible by the 2 replicas of the 4 ranks, not by the 4 ranks.
    config = load_config([*flags, "--n-samples-per-prompt", "3", "--actor-num-gpus-per-node", "4"])
    assert (config.model_parallel_size, config.data_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match=r"3 train ranks .* not a multiple of the 2 ranks"):
        load_config([*flags, "--actor-num-gpus-per-node", "3"])
