"""`TrainerArgs`: the settings every training backend shares (optimizer, learning-rate schedule,
batching, weight push), with their checks; a backend's settings group subclasses it.

A flag means the same thing in every backend because it is declared once, here. Subclasses add
their own fields and checks and call `super().__post_init__()` first.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from miles.config.lora_args import LoraArgs
from miles.config.options import flag_name as flag


@dataclass(kw_only=True)
class TrainerArgs(LoraArgs):
    """Optimizer, schedule, batching and weight-push settings shared by the training backends,
    and the LoRA settings of `LoraArgs`."""

    lr: float = 1e-6
    """Peak learning rate (after warmup)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay; needs a decaying --lr-decay-style."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.98
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW denominator epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    lr_decay_style: Literal["constant", "linear", "cosine", "wsd"] = "constant"
    """Shape of the learning rate after warmup (wsd: warmup-stable-decay)."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear warmup from 0 to --lr."""
    lr_decay_iters: int | None = None
    """Optimizer step at which the rate reaches --min-lr (warmup included); None: the backend
    uses the total number of optimizer steps of the run."""
    lr_wsd_decay_iters: int | None = None
    """Length of the final decay phase of --lr-decay-style wsd, in optimizer steps."""
    micro_batch_size: int = 1
    """Samples per forward/backward pass when --use-dynamic-batch-size is off."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches up to --max-tokens-per-gpu tokens instead of a fixed sample count."""
    max_tokens_per_gpu: int | None = None
    """Token budget of one micro-batch per GPU; required by, and only used with,
    --use-dynamic-batch-size."""
    update_weight_buffer_size: int = 512 * 2**20
    """Bytes of gathered parameters per bucket when pushing weights to the rollout engines."""
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as the old policy instead of recomputing them in the trainer."""
    seed: int = 1234
    """Seed of model initialisation and every random number generator of the trainer; the
    rollout engines' samplers are seeded from it too (plus each engine's index)."""

    trains_critic: typing.ClassVar[bool] = False
    """Whether the backend trains PPO's value model (--advantage-estimator ppo)."""

    # Smallest valid value of numeric fields; a subclass extends it with its own.
    MINIMUMS: typing.ClassVar[dict[str, float]] = {
        "lr": 0.0,
        "min_lr": 0.0,
        "weight_decay": 0.0,
        "clip_grad": 0.0,
        "lr_warmup_iters": 0,
        "micro_batch_size": 1,
        "update_weight_buffer_size": 1,
    }

    @property
    def model_parallel_size(self) -> int:
        """Train ranks one model replica takes; a backend that splits a replica over ranks
        (tensor / pipeline / context parallelism) overrides this."""
        return 1

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_ranges()
        self._check_schedule()
        self._check_batching()
        self._check_lora()

    def check_checkpoint(self, hf_checkpoint: str) -> None:
        """Refuse settings that do not fit the model of `hf_checkpoint` (a local directory),
        when the config is built; a backend with such settings overrides this."""

    def _check_choices(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            annotation: Any = hints[f.name]
            choices = get_args(annotation) if get_origin(annotation) is Literal else ()
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ValueError(
                    f"{flag(f.name)} {value!r} is not a valid choice; use one of "
                    f"{', '.join(choices)}"
                )

    def _check_ranges(self) -> None:
        for name, minimum in self.MINIMUMS.items():
            if getattr(self, name) < minimum:
                raise ValueError(f"{flag(name)} must be >= {minimum}, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"--adam-eps must be > 0, got {self.adam_eps}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")

    def _check_schedule(self) -> None:
        style = self.lr_decay_style
        if style == "constant":
            for name in ("min_lr", "lr_decay_iters"):
                value = getattr(self, name)
                if value not in (None, 0.0):
                    raise ValueError(
                        f"{flag(name)} ({value}) has no effect with --lr-decay-style constant; "
                        "drop it or choose linear, cosine or wsd"
                    )
        if style != "wsd" and self.lr_wsd_decay_iters is not None:
            raise ValueError(
                f"--lr-wsd-decay-iters ({self.lr_wsd_decay_iters}) only applies to "
                f"--lr-decay-style wsd, not {style}; drop it or use --lr-decay-style wsd"
            )
        if style == "wsd" and self.lr_wsd_decay_iters is None:
            raise ValueError(
                "--lr-decay-style wsd needs --lr-wsd-decay-iters (steps of the final decay phase)"
            )
        if self.lr_wsd_decay_iters is not None and self.lr_wsd_decay_iters < 1:
            raise ValueError(f"--lr-wsd-decay-iters must be >= 1, got {self.lr_wsd_decay_iters}")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(
                f"--lr-decay-iters ({self.lr_decay_iters}) must exceed --lr-warmup-iters "
                f"({self.lr_warmup_iters}): decay starts after warmup"
            )

    def _check_batching(self) -> None:
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError(
                "--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget of one "
                "micro-batch); set it, e.g. --max-tokens-per-gpu 8192"
            )
        if not self.use_dynamic_batch_size and self.max_tokens_per_gpu is not None:
            raise ValueError(
                f"--max-tokens-per-gpu ({self.max_tokens_per_gpu}) is only used with "
                "--use-dynamic-batch-size; add that flag or drop --max-tokens-per-gpu"
            )
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {self.max_tokens_per_gpu}")
