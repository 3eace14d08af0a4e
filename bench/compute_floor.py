"""The compute floor of an RL step: the matmul FLOPs its generation and training need, counted
from the model config, and the rate this machine multiplies fp32 matrices at (torch's sgemm).

Only matmuls count (2 FLOPs a multiply-add): norms, activations, softmax, sampling and the
optimizer are left out, as torch's `FlopCounterMode` leaves them out. The floor is a lower bound
of the step's time, not a prediction: no real kernel runs every matmul at sgemm's best rate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from miles.utils.cpu_cores import usable_cores

# -- FLOPs of a forward, from the model config ---------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a dense decoder (Qwen3, Llama) that its matmuls' FLOPs depend on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config, or its `config.json` as a dict."""
        get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
        heads = get("num_attention_heads")
        return cls(
            hidden=get("hidden_size"), intermediate=get("intermediate_size"),
            layers=get("num_hidden_layers"), heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or get("hidden_size") // heads, vocab=get("vocab_size"),
        )  # fmt: skip

    @property
    def token_flops(self) -> int:
        """Forward FLOPs of one token apart from attention to other tokens: per layer the q and o
        projections (hidden x heads*head_dim), the k and v ones (hidden x kv_heads*head_dim,
        grouped-query attention) and the gated MLP (gate, up, down: hidden x intermediate),
        then the LM head (hidden x vocab)."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return 2 * (self.layers * (q_and_o + k_and_v + mlp) + self.hidden * self.vocab)

    @property
    def pair_flops(self) -> int:
        """Forward FLOPs of one (query, key) pair of attention, over all layers: the score q.k
        and the weighted value, head_dim multiply-adds each per query head."""
        return self.layers * 2 * (2 * self.heads * self.head_dim)

    def forward_flops(self, tokens: float, *, cached: float = 0.0) -> float:
        """A causal forward of `tokens` tokens after `cached` ones already in the KV cache: the
        i-th new token attends to cached + i keys, itself included (no masked-out pairs)."""
        pairs = tokens * cached + tokens * (tokens + 1) / 2
        return tokens * self.token_flops + pairs * self.pair_flops


# -- FLOPs of a rollout's generation and training ------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RolloutShape:
    """One RL step's batch: `prompts` groups of `samples` responses each."""

    prompts: int
    samples: int
    prompt_len: float
    response_len: float
    """Tokens a response has: the mean where they vary and the batch is packed, the longest
    where every row is padded to it."""

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples


def generation_flops(model: ModelShape, rollout: RolloutShape, *, share_prompt: bool) -> float:
    """Prefill and decode FLOPs of generating the rollout with a KV cache. `share_prompt`: a
    group's prompt is prefilled once (an engine's prefix sharing), else once per sample. The
    prefill yields each response's first token; the others cost one decode forward each (the
    last token is sampled, never forwarded)."""
    prefills = rollout.prompts if share_prompt else rollout.sequences
    prefill = prefills * model.forward_flops(rollout.prompt_len)
    decode_tokens = max(rollout.response_len - 1, 0.0)
    decode = rollout.sequences * model.forward_flops(decode_tokens, cached=rollout.prompt_len)
    return prefill + decode


def training_flops(model: ModelShape, rollout: RolloutShape, *, share_prompt: bool) -> float:
    """Forward and backward FLOPs of training on the rollout's tokens (prompts and responses);
    the backward is twice the forward (gradients of the activations and of the weights).
    `share_prompt`: a group's prompt is forwarded once and each response after it on its KV cache
    (miles's --share-prompt-forward), else every sample forwards its prompt with its response."""
    if share_prompt:
        prompts = rollout.prompts * model.forward_flops(rollout.prompt_len)
        responses = rollout.sequences * model.forward_flops(
            rollout.response_len, cached=rollout.prompt_len
        )
        forward = prompts + responses
    else:
        forward = rollout.sequences * model.forward_flops(rollout.prompt_len + rollout.response_len)
    return 3 * forward


# -- the machine's rate --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MachineRate:
    """torch's fp32 matmul rate on this machine, GFLOP/s, best of a few square matmuls."""

    cores: int
    one_thread: float
    all_cores: float


def sgemm_gflops(threads: int, *, size: int = 2048, repeats: int = 5) -> float:
    """The best rate of `repeats` (size x size) @ (size x size) fp32 matmuls on `threads` torch
    threads (the setting is restored after). Best, not mean: the machine's capability, which a
    busy neighbour can only lower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        a, b = (torch.randn(size, size, generator=generator) for _ in range(2))
        out = torch.empty(size, size)
        torch.mm(a, b, out=out)  # warm-up: thread pool and allocation
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * size**3 / best / 1e9


def measure_machine() -> MachineRate:
    """sgemm's rate on one thread and on every core this process may run on."""
    cores = usable_cores()
    return MachineRate(cores=cores, one_thread=sgemm_gflops(1), all_cores=sgemm_gflops(cores))


# -- the floor of a step -------------------------------------------------------------------------


def phase_rate(flops: float, seconds: float, machine: MachineRate) -> dict[str, float]:
    """What a phase achieved: its GFLOP, GFLOP/s and the fraction of the machine's rates."""
    achieved = flops / seconds / 1e9 if seconds > 0 else math.nan
    return {
        "gflop": flops / 1e9,
        "seconds": seconds,
        "gflop_per_s": achieved,
        "of_one_thread": achieved / machine.one_thread,
        "of_all_cores": achieved / machine.all_cores,
    }


def step_floor(flops: float, step_s: float, machine: MachineRate) -> dict[str, float]:
    """The step's compute floor (its FLOPs at every core's sgemm rate) and how far above it the
    step ran."""
    floor_s = flops / 1e9 / machine.all_cores
    return {"gflop": flops / 1e9, "floor_s": floor_s, "step_over_floor": step_s / floor_s}


def format_floor(name: str, phases: dict[str, dict[str, float]], step: dict[str, float]) -> str:
    """A few lines for a benchmark's report: each phase's rate, then the step against its floor."""
    lines = [f"{name} compute (GFLOP, s, GFLOP/s, share of sgemm on 1 thread / all cores):"]
    for phase, p in phases.items():
        lines.append(
            f"  {phase:26}{p['gflop']:>8.1f}{p['seconds']:>8.3f}{p['gflop_per_s']:>8.1f}"
            f"{p['of_one_thread']:>8.1%}{p['of_all_cores']:>8.1%}"
        )
    lines.append(
        f"  step {step['gflop']:.1f} GFLOP: floor {step['floor_s']:.3f} s at all cores' sgemm, "
        f"the step takes {step['step_over_floor']:.1f}x that"
    )
    return "\n".join(lines)
