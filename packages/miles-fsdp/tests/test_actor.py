"""FSDPTrainRayActor on real gloo groups: exact gradients under every mesh shape, packing that
never attends across documents, the resume / sleep / export life cycle, and refused flags."""

from __future__ import annotations

import dataclasses
import math
import random
import socket
from pathlib import Path

import pytest
import torch

from .distributed import run_distributed

GLOBAL_BATCH = 8
SAMPLES = 16  # two optimizer steps per rollout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_checkpoint(path: Path, seed: int = 0) -> Path:
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(path, seed=seed)


@dataclasses.dataclass
class InitArgs:
    """What FSDPTrainRayActor.init takes: the run spec, the loss config, the backend's args."""

    spec: object
    loss: object
    fsdp: object

    def with_paths(self, **paths: str) -> InitArgs:
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, **paths))


def make_args(checkpoint: Path, *, loss: dict | None = None, **fsdp: object) -> InitArgs:
    """`fsdp` overrides FSDPArgs fields, `loss` LossConfig fields."""
    from miles.backends.fsdp_utils.arguments import FSDPArgs
    from miles.backends.training_utils.algorithms.loss_config import LossConfig
    from miles.train_backend import TrainRunSpec

    settings = {"lr": 1e-3, "clip_grad": 0.05, "micro_batch_size": 1, "seed": 0}
    settings.update(fsdp)
    spec = TrainRunSpec(
        hf_checkpoint=str(checkpoint), rollout_temperature=0.8, global_batch_size=GLOBAL_BATCH,
        num_rollout=1, num_steps_per_rollout=SAMPLES // GLOBAL_BATCH, colocate=True,
    )  # fmt: skip
    return InitArgs(spec=spec, loss=LossConfig(**(loss or {})), fsdp=FSDPArgs(**settings))


def make_batch(num_samples: int = SAMPLES, seed: int = 0) -> dict[str, list]:
    """Random documents of uneven length, some response tokens masked out."""
    rng = random.Random(seed)
    batch: dict[str, list] = {k: [] for k in ("tokens", "response_lengths", "total_lengths")}
    batch.update(loss_mask=[], rewards=[])
    for _ in range(num_samples):
        prompt, response = rng.randint(2, 7), rng.randint(2, 8)
        tokens = [rng.randrange(256) for _ in range(prompt + response)]
        mask = [1] * response
        mask[rng.randrange(response)] = rng.choice([0, 1])
        batch["tokens"].append(tokens)
        batch["response_lengths"].append(response)
        batch["total_lengths"].append(len(tokens))
        batch["loss_mask"].append(mask)
        batch["rewards"].append(rng.uniform(-1, 1))
    return batch


def make_actor(rank: int, world_size: int, args: InitArgs, with_ref: bool = False):
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor

    # The test harness already formed the group; setup_distributed keeps it.
    actor = FSDPTrainRayActor(rank, world_size, "127.0.0.1", free_port())
    start = actor.init(args.spec, args.loss, args.fsdp, with_ref=with_ref)
    return actor, start


def local_shard(batch: dict, rank: int, world_size: int) -> dict:
    """Round-robin rows, so global step s is rows [s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)."""
    from miles.backends.training_utils.batching.train_batches import get_rollout_data

    return get_rollout_data(batch, rank, world_size, balance=False)


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


# -- single-process reference ------------------------------------------------------------------


def sample_log_probs(model, tokens: list[int], response_length: int, temperature: float):
    """Log-probs of one document's response, from an unpacked forward."""
    from miles.backends.training_utils.step.logprobs import get_log_probs_and_entropy

    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0]  # (L, V)
    end = len(tokens) - 1
    positions = torch.arange(end - response_length, end)
    return get_log_probs_and_entropy(
        logits[positions], ids[0, positions + 1], temperature=temperature
    )


def reference_training(
    args: InitArgs, batch: dict, *, model=None, log_probs_of=None
) -> tuple[list[dict], list[float], dict]:
    """Plain transformers, one unpacked document at a time: grads per step, norms, final params.
    `model` (default: the checkpoint as a causal LM) and `log_probs_of(model, row)` (default: an
    unpacked forward of the row's tokens) let another kind of model (a VLM) be the reference."""
    from transformers import AutoModelForCausalLM

    from miles.backends.training_utils.algorithms.algorithm import compute_advantages_and_returns
    from miles.backends.training_utils.algorithms.loss import LossNormalizer, policy_loss

    fsdp, temperature = args.fsdp, args.spec.rollout_temperature
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(
            args.spec.hf_checkpoint, dtype=torch.float32,
            attn_implementation=fsdp.attn_implementation,
        )  # fmt: skip
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=fsdp.lr, betas=(fsdp.adam_beta1, fsdp.adam_beta2),
        eps=fsdp.adam_eps, weight_decay=fsdp.weight_decay,
    )  # fmt: skip
    batch = dict(batch)
    documents = list(zip(batch["tokens"], batch["response_lengths"], strict=True))
    if log_probs_of is None:

        def log_probs_of(model, row):
            return sample_log_probs(model, *documents[row], temperature)

    with torch.no_grad():
        old = [log_probs_of(model, row)[0] for row in range(len(documents))]
    batch["old_log_probs"], batch["ref_log_probs"] = old, old  # the reference model is the start
    compute_advantages_and_returns(batch, args.loss, group=None)
    grads, norms = [], []
    for step in range(len(batch["tokens"]) // GLOBAL_BATCH):
        rows = range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        tokens = sum(sum(batch["loss_mask"][i]) for i in rows)
        normalizer = LossNormalizer(num_samples=GLOBAL_BATCH, num_tokens=tokens, dp_size=1)
        for i in rows:
            log_probs, entropy = log_probs_of(model, i)
            inputs = {
                "log_probs": log_probs,
                "entropy": entropy,
                "response_lengths": [documents[i][1]],
                "loss_mask": torch.tensor(batch["loss_mask"][i], dtype=torch.float32),
                "old_log_probs": old[i],
                "advantages": batch["advantages"][i],
                "ref_log_probs": old[i],
            }
            loss, _ = policy_loss(inputs, args.loss, normalizer)
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), fsdp.clip_grad)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return grads, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


# -- gradients and optimizer steps under every mesh --------------------------------------------

MESH_CASES = [
    # (dp_replicate x dp_shard on 4 ranks, FSDPArgs overrides, LossConfig overrides)
    (1, {}, {"use_kl_loss": True, "kl_loss_coef": 0.5}),
    (2, {"gradient_checkpointing": True, "fsdp_gather": "micro_batch"},
     {"loss_reduction": "token_mean"}),
    (
        4,
        {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 24,
         "attn_implementation": "eager"},
        {"eps_clip": 0.1},
    ),
]  # fmt: skip


def _train_under_meshes(rank: int, checkpoint: Path) -> list[dict]:
    """Every mesh in one set of processes (a launch costs more than a training run here)."""
    batch, results = make_batch(), []
    for replicate, fsdp, loss in MESH_CASES:
        args = make_args(checkpoint, loss=loss, dp_replicate_size=replicate, **fsdp)
        actor, _ = make_actor(rank, 4, args, with_ref=loss.get("use_kl_loss", False))
        captured = capture_full_grads(actor)
        shard = local_shard(batch, rank, 4)
        metrics = actor.train(0, shard)
        sharded = _left_sharded(actor.engine.model)
        params = full_params(actor.engine.model)
        if rank != 0:
            results.append({})
            continue
        ref_grads, ref_norms, ref_params = reference_training(args, batch)
        results.append(
            {
                "mesh": tuple(actor.engine.model.model.embed_tokens.weight.device_mesh.shape),
                "norms": [m["train/grad_norm"] for m in metrics],
                "ref_norms": ref_norms,
                "grad_diff": [_max_rel_diff(c, r) for c, r in zip(captured, ref_grads, strict=True)],
                "param_diff": _max_rel_diff(params, ref_params),
                "gather_per_step": actor.engine.gather_per_step,
                "left_sharded": sharded,
            }
        )  # fmt: skip
    results[-1]["sharded_after_a_failure"] = _fail_midway(actor, shard)
    return results


def _left_sharded(model) -> bool:
    """No layer left gathered, no gradient left unreduced."""
    from torch.distributed.tensor import DTensor

    from miles.backends.fsdp_utils.modeling import unreduced_grads

    return all(isinstance(p, DTensor) for p in model.parameters()) and not unreduced_grads(model)


def _fail_midway(actor, shard: dict) -> bool:
    """A loss that raises on the second of three micro-batches, after the first's backward."""
    from miles.backends.training_utils.batching.rollout_data import select_rows

    def loss_fn(index, log_probs, entropy, scored):
        if index == 1:
            raise RuntimeError("a loss that fails midway")
        return log_probs.sum(), {}

    micro_batches = [select_rows(shard, [row]) for row in range(3)]
    with pytest.raises(RuntimeError, match="fails midway"):
        actor.engine.forward_backward(micro_batches, loss_fn)
    return _left_sharded(actor.engine.model)


def capture_full_grads(actor) -> list[dict[str, torch.Tensor]]:
    """Full gradients seen by each optimizer step (after clipping), appended as steps run."""
    names = {id(p): n for n, p in actor.engine.model.named_parameters()}
    captured: list[dict[str, torch.Tensor]] = []

    def capture(optimizer, *_):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        captured.append({names[id(p)]: p.grad.full_tensor() for p in params})

    actor.engine.optimizer.register_step_pre_hook(capture)
    return captured


def _max_rel_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), f"parameter names differ: {got.keys() ^ want.keys()}"
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12)) for k in want
    )


def test_gradients_and_steps_under_every_mesh_equal_a_single_process_reference(tmp_path):
    checkpoint = build_checkpoint(tmp_path / "ckpt")
    rank0 = run_distributed(_train_under_meshes, 4, checkpoint, timeout_s=240)[0]
    meshes = [case["mesh"] for case in rank0]
    assert meshes == [(4,), (2, 2), (4, 1)]
    for case in rank0:
        # Clipping is active (the norm exceeds --clip-grad), so the full-norm clip is tested too.
        assert min(case["ref_norms"]) > 0.05
        torch.testing.assert_close(case["norms"], case["ref_norms"], rtol=1e-4, atol=0)
        assert max(case["grad_diff"]) < 1e-4, case
        assert case["param_diff"] < 1e-4, case
        assert case["left_sharded"], case
    # --fsdp-gather: auto gathers once per step on CPU; the second mesh asks for per micro-batch.
    assert [case["gather_per_step"] for case in rank0] == [True, False, True]
    assert rank0[-1]["sharded_after_a_failure"]


# -- packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_logits_equal_per_document_logits(tmp_path, attn_implementation):
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.modeling import packed_logits
    from miles.backends.training_utils.batching.packing import pack_sequences

    checkpoint = build_checkpoint(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation=attn_implementation
    )
    docs = make_batch(4, seed=3)
    packed = pack_sequences(docs["tokens"], docs["response_lengths"], docs["loss_mask"], 8)
    with torch.no_grad():
        logits = packed_logits(
            model, packed, attn_implementation=attn_implementation, device=torch.device("cpu")
        )  # (T, V)
        for i, tokens in enumerate(docs["tokens"]):
            alone = model(input_ids=torch.tensor([tokens])).logits[0]  # (L, V)
            start, end = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
            torch.testing.assert_close(logits[start:end], alone, rtol=1e-5, atol=1e-5)
        # The mask is what keeps documents apart: a plain causal row leaks across them.
        leaky = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits[0]
        assert (leaky - logits).abs().max() > 1e-3
    # Gradients flow to each document's own positions (the padding's rows are constant zeros).
    assert packed.num_pad_tokens > 0
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    device = torch.device("cpu")
    (packed_logits(model, packed, attn_implementation=attn_implementation, device=device)
     * weights).sum().backward()  # fmt: skip
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for i, tokens in enumerate(docs["tokens"]):
        start, end = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
        (model(input_ids=torch.tensor([tokens])).logits[0] * weights[start:end]).sum().backward()
    for packed_grad, p in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(packed_grad, p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_logits_at_response_positions_are_those_of_the_whole_row(
    tmp_path, attn_implementation
):
    # The head runs only where a loss reads (logits_to_keep): the same rows, the same
    # gradients, as taking those rows of every position's logits.
    from transformers import AutoModelForCausalLM

    from miles.backends.fsdp_utils.modeling import packed_logits, response_positions
    from miles.backends.training_utils.batching.packing import pack_sequences

    checkpoint = build_checkpoint(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float64, attn_implementation=attn_implementation
    )
    docs = make_batch(4, seed=5)
    packed = pack_sequences(docs["tokens"], docs["response_lengths"], docs["loss_mask"], 8)
    positions = response_positions(packed)
    cpu = torch.device("cpu")
    weights = torch.randn(len(positions), model.config.vocab_size, dtype=torch.float64)
    grads = []
    for keep in (False, True):
        model.zero_grad()
        if keep:
            logits = packed_logits(
                model, packed, attn_implementation=attn_implementation, device=cpu,
                positions=positions,
            )  # fmt: skip
        else:
            whole = packed_logits(
                model, packed, attn_implementation=attn_implementation, device=cpu
            )
            logits = whole[positions]
        (logits * weights).sum().backward()
        grads.append(([p.grad.clone() for p in model.parameters()], logits.detach()))
    (whole_grads, whole_logits), (kept_grads, kept_logits) = grads
    assert kept_logits.shape == (len(positions), model.config.vocab_size)
    torch.testing.assert_close(kept_logits, whole_logits, rtol=1e-12, atol=1e-12)
    for kept, whole in zip(kept_grads, whole_grads, strict=True):
        torch.testing.assert_close(kept, whole, rtol=1e-10, atol=1e-12)


# -- refused flags ---------------------------------------------------------------------------

REFUSED = [
    # (FSDPArgs overrides, LossConfig overrides, role, the flag the error must name)
    ({"lora_rank": -8}, {}, "actor", "--lora-rank"),
    ({"context_parallel_size": 2}, {}, "actor", "--context-parallel-size"),
    ({"attn_implementation": "flash_attention_2"}, {}, "actor", "--attn-implementation"),
    ({"fsdp_cpu_offload": True}, {}, "actor", "--fsdp-cpu-offload"),
    ({}, {}, "critic", "role 'critic'"),
    ({}, {"advantage_estimator": "ppo"}, "actor", "--advantage-estimator ppo"),  # no spec.critic
    ({"use_rollout_logprobs": True}, {"off_policy_correction": "tis"}, "actor", "--use-rollout-logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(("fsdp", "loss", "role", "flag"), REFUSED)
def test_a_setting_the_backend_would_ignore_is_refused_naming_its_flag(
    tmp_path, monkeypatch, fsdp, loss, role, flag
):
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
    from miles.backends.training_utils.infra.device import get_device_info

    monkeypatch.setenv("MILES_DEVICE", "cpu")
    get_device_info.cache_clear()
    actor = FSDPTrainRayActor(0, 1, "127.0.0.1", free_port())
    # Refused either where FSDPArgs is built or in init, before any process group forms.
    with pytest.raises(ValueError, match=flag.replace("-", r"\-")):
        args = make_args(tmp_path, loss=loss, **fsdp)
        actor.init(args.spec, args.loss, args.fsdp, role=role)
    get_device_info.cache_clear()


# -- life cycle: resume, sleep / wake-up, export, data checks -------------------------------------


def _life_cycle(rank: int, checkpoint: Path, save_dir: Path, export_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from tests.support.rollout_batches import reference_scored, scored_forward, with_scored_ids

    args = make_args(checkpoint, use_rollout_logprobs=True).with_paths(save=str(save_dir))
    actor, start = make_actor(rank, 2, args)
    batch = make_batch(SAMPLES)
    # The log-probs of K given ids per response position (--opd-kl-mode topk's teacher tokens)
    # equal a float64 forward of the start checkpoint, and so do the response's beside them.
    micro = with_scored_ids(local_shard(batch, rank, 2), 3, seed=rank)
    got = scored_forward(actor.engine, micro)
    want = reference_scored(
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64), micro, 0.8
    )
    scored_gap = max(float((got[k] - want[k]).abs().max()) for k in ("log_probs", "scored"))
    batch["rollout_log_probs"] = [[-1.0] * r for r in batch["response_lengths"]]
    actor.train(0, local_shard(batch, rank, 2))
    actor.save_model(0)
    saved = full_params(actor.engine.model)

    # A step whose gradient is not finite is skipped and touches nothing: weights, the optimizer's
    # moments and step counts, and the schedule stay as they were.
    state, schedule = _optimizer_state(actor.engine.optimizer), actor.engine.lr_scheduler.last_epoch
    poisoned = {**batch, "rewards": [math.nan] * len(batch["rewards"])}
    poisoned_steps = actor.train(1, local_shard(poisoned, rank, 2))
    after = _optimizer_state(actor.engine.optimizer)
    skipped_untouched = (
        all(not math.isfinite(step["train/grad_norm"]) for step in poisoned_steps)
        and all(torch.equal(saved[n], p) for n, p in full_params(actor.engine.model).items())
        and state.keys() == after.keys()
        and all(torch.equal(state[k], after[k]) for k in state)
        and actor.engine.lr_scheduler.last_epoch == schedule
    )

    actor.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        actor.train(1, local_shard(batch, rank, 2))
    actor.wake_up()
    asleep_kept = all(torch.equal(saved[n], p) for n, p in full_params(actor.engine.model).items())
    actor.train(1, local_shard(batch, rank, 2))  # moves away from the checkpoint
    with pytest.raises(TypeError, match="RolloutBatch"):
        actor.train(2, [batch])
    with pytest.raises(ValueError, match="--global-batch-size"):
        actor.train(2, local_shard(make_batch(6), rank, 2))

    resumed, resumed_start = make_actor(rank, 2, args.with_paths(load=str(save_dir)))
    model = resumed.engine.model
    restored = all(torch.equal(saved[n], p) for n, p in full_params(model).items())
    resumed.export_hf(export_dir)
    exported = {}
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
        exported = {n: p.detach() for n, p in model.named_parameters()}
    return {
        "start": start,
        "scored_gap": scored_gap,
        "skipped_untouched": skipped_untouched,
        "resumed_start": resumed_start,
        "asleep_kept": asleep_kept,
        "restored": restored,
        "weight_version": resumed.weight_version,
        "export_matches": all(torch.equal(saved[n], exported[n]) for n in exported)
        and len(exported) == len(saved),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def _optimizer_state(optimizer) -> dict[str, torch.Tensor]:
    """This rank's shard of every optimizer state tensor, cloned, keyed by position."""
    state = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    state[f"{g}/{i}/{key}"] = local.detach().clone()
    return state


def test_resume_sleep_and_export_keep_the_trained_weights(tmp_path):
    checkpoint = build_checkpoint(tmp_path / "ckpt")
    results = run_distributed(
        _life_cycle, 2, checkpoint, tmp_path / "save", tmp_path / "export", timeout_s=240
    )
    for rank, result in enumerate(results):
        assert result["start"] == 0
        assert result["scored_gap"] < 1e-4, f"rank {rank}: scored log-probs differ from HF's"
        assert result["skipped_untouched"], f"rank {rank}: a skipped step changed the state"
        assert result["resumed_start"] == 1, "the next rollout after the saved rollout 0"
        assert result["asleep_kept"], f"rank {rank}: sleep / wake_up changed the weights"
        assert result["restored"], f"rank {rank}: resuming did not restore the saved weights"
        assert result["tied"], "tied embeddings must stay one parameter"
    assert results[0]["export_matches"], "the HF export differs from the trained weights"
