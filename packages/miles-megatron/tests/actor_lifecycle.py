"""What the train-actor tests on CPU (through the shim) and on a GPU share: batches, the HF
reference, state snapshots, and a reference engine to push weights to."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from miles.backends.sglang_utils.reference_engine.launcher import launch_reference_engine
from tests.support.rollout_batches import random_rollout_batch

GLOBAL_BATCH = 4
TEMPERATURE = 0.8
PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, " in the byte tokenizer


@dataclasses.dataclass
class InitArgs:
    """What MegatronTrainRayActor.init takes: the run spec, the loss config, the backend's args."""

    spec: object
    loss: object
    megatron: object

    def init(self, actor) -> int:
        return actor.init(self.spec, self.loss, self.megatron)


def make_args(checkpoint: Path, save_dir: Path, **megatron: object) -> InitArgs:
    """`megatron` overrides MegatronArgs fields."""
    from miles.backends.megatron_utils.arguments import MegatronArgs
    from miles.backends.training_utils.algorithms.loss_config import LossConfig
    from miles.train_backend import TrainRunSpec

    settings = {"lr": 1e-3, "seed": 0, **megatron}
    spec = TrainRunSpec(
        hf_checkpoint=str(checkpoint), rollout_temperature=TEMPERATURE,
        global_batch_size=GLOBAL_BATCH, num_rollout=4, num_steps_per_rollout=2,
        save=str(save_dir), load=str(save_dir), colocate=True,
    )  # fmt: skip
    return InitArgs(spec=spec, loss=LossConfig(), megatron=MegatronArgs(**settings))


def point_at_engine(actor, url: str, *, colocate: bool = True) -> None:
    """Make the initialized `actor` push its weights to the engine at `url`."""
    actor.spec = dataclasses.replace(actor.spec, colocate=colocate)
    actor.connect_engines([url])


def make_batch(seed: int, num_samples: int = 2 * GLOBAL_BATCH) -> dict[str, list]:
    """Random documents of uneven length: two optimizer steps at GLOBAL_BATCH."""
    return random_rollout_batch(num_samples, seed=seed)


def with_rollout_log_probs(model_dir: Path, batch: dict, device: torch.device) -> dict:
    """The batch with the response log-probs a float32 engine running `model_dir` reports."""
    from transformers import AutoModelForCausalLM

    from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    out = []
    for tokens, r in zip(batch["tokens"], batch["response_lengths"], strict=True):
        ids = torch.tensor([tokens], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        lp, _ = get_log_probs_and_entropy(
            logits[len(tokens) - r - 1 : -1], ids[0, len(tokens) - r :], temperature=TEMPERATURE
        )
        out.append(lp.cpu().tolist())
    return {**batch, "rollout_log_probs": out}


def snapshot(actor) -> dict[str, torch.Tensor]:
    """Parameters, master weights and Adam state, cloned to the CPU, keyed by position."""
    state = {
        f"param/{n}": p.detach().cpu().clone()
        for n, p in actor.engine.model.module.named_parameters()
    }
    optimizer = actor.engine.optimizer
    for i, part in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = part.optimizer
        for j, group in enumerate(inner.param_groups):
            for k, main in enumerate(group["params"]):
                state[f"main/{i}/{j}/{k}"] = main.detach().cpu().clone()
                for key, value in inner.state.get(main, {}).items():
                    if isinstance(value, torch.Tensor):
                        state[f"{key}/{i}/{j}/{k}"] = value.detach().cpu().clone()
    return state


def weights_of(state: dict) -> dict[str, torch.Tensor]:
    """The model parameters of a snapshot (optimizer state appears only at the first step)."""
    return {k: v for k, v in state.items() if k.startswith("param/")}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def differing(a: dict, b: dict) -> list[str]:
    """The keys whose tensors differ: what a failed comparison prints."""
    return [k for k in a if not torch.equal(a[k], b[k])]


def reference_engine(model_path: Path, device: str):
    """A float32 reference engine on `device`, healthy when entered; stopped on exit."""
    return launch_reference_engine(
        model_path, extra_args=["--dtype", "float32", "--device", device]
    )


def engine_vs_trainer(actor, url: str) -> dict:
    """Greedy-decode on the engine, score the same tokens on the trainer at temperature 1 (the
    engine's greedy log-probs); every rank must call it."""
    answer = [None]
    if dist.get_rank() == 0:
        body = {"input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}  # fmt: skip
        answer[0] = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    dist.broadcast_object_list(answer, src=0)  # the trainer forward is a collective
    output, meta = answer[0]["output_ids"], answer[0]["meta_info"]
    tokens = PROMPT + output
    batch = {"tokens": [tokens], "response_lengths": [len(output)],
             "total_lengths": [len(tokens)], "loss_mask": [[1] * len(output)]}  # fmt: skip
    saved, actor.engine.forward.temperature = actor.engine.forward.temperature, 1.0
    try:
        trainer = actor.trainer.log_probs(batch)[0].float().cpu()
    finally:
        actor.engine.forward.temperature = saved
    engine = torch.tensor([item[0] for item in meta["output_token_logprobs"]])
    return {"diff": float((trainer - engine).abs().max()), "version": meta["weight_version"]}
