"""The algorithm settings that the advantage and loss code reads, validated where they are built.

A setting that the chosen estimator or loss would ignore is an error naming the flag
(architecture.md: "Design rules"): a run never silently trains with a KL or clip setting
that has no effect. The names of losses and estimators are those of the registry (`registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from miles.backends.training_utils.algorithms import registry
from miles.backends.training_utils.infra.import_path import split_import_path

KLType = Literal["k1", "k2", "k3", "low_var_kl"]
"""--kl-loss-type: the KL estimators of `formulas.kl.compute_approx_kl`."""
KL_TYPES: tuple[str, ...] = get_args(KLType)
LossReduction = Literal["sample_mean", "token_mean", "constant"]
OffPolicyCorrection = Literal["tis", "icepop", "mis"]


@dataclass(kw_only=True)
class LossConfig:
    """How advantages are estimated and how the per-token loss is formed and reduced."""

    advantage_estimator: str = "grpo"
    """--advantage-estimator: grpo, dr_grpo, gspo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, ppo (needs a critic), or custom (with
    --custom-advantage-function-path)."""
    custom_advantage_function_path: str | None = None
    """--custom-advantage-function-path: "pkg.mod:fn" for --advantage-estimator custom: fn(batch,
    config, loss_masks, dp_group) -> (advantages, returns), or a `registry.EstimatorSpec`."""
    loss_type: str = "policy_loss"
    """--loss-type: policy_loss (the clipped policy-gradient loss), sft_loss (negative
    log-likelihood), or custom_loss (with --custom-loss-function-path)."""
    custom_loss_function_path: str | None = None
    """--custom-loss-function-path: "pkg.mod:fn" for --loss-type custom_loss: fn(inputs, config,
    normalizer) -> (loss, metrics), or a `registry.LossSpec` that also names its inputs."""
    loss_reduction: LossReduction = "sample_mean"
    """--loss-reduction: sample_mean (mean over a sample's tokens, then over samples), token_mean
    (--calculate-per-token-loss: every trainable token of the global batch weighs the same), or
    constant (Dr.GRPO: token sum / (samples x --loss-constant-normalizer))."""
    loss_constant_normalizer: int | None = None
    """--loss-constant-normalizer: tokens per sample in the constant reduction (e.g. the max
    response length); only with --loss-reduction constant."""
    grpo_std_normalization: bool = True
    """--grpo-std-normalization: divide group-centred rewards by the group std (grpo, gspo)."""
    eps_clip: float = 0.2
    """--eps-clip: lower clip range of the ratio, 1 - eps_clip."""
    eps_clip_high: float | None = None
    """--eps-clip-high: upper clip range, 1 + eps_clip_high (defaults to --eps-clip)."""
    eps_clip_c: float | None = None
    """--eps-clip-c: dual-clip bound (> 1) on the loss of negative-advantage tokens."""
    entropy_coef: float = 0.0
    """--entropy-coef: weight of the entropy bonus (subtracted from the loss)."""
    kl_coef: float = 0.0
    """--kl-coef: KL penalty folded into token rewards (token-reward estimators only)."""
    use_kl_loss: bool = False
    """--use-kl-loss: add a KL-to-reference term to the loss."""
    kl_loss_coef: float = 0.0
    """--kl-loss-coef: weight of that term."""
    kl_loss_type: str = "low_var_kl"
    """--kl-loss-type: k1, k2, k3 or low_var_kl."""
    gamma: float = 1.0
    """--gamma: discount (reinforce_plus_plus, ppo)."""
    lambd: float = 1.0
    """--lambd: GAE lambda (ppo)."""
    value_clip: float = 0.2
    """--value-clip: clip range of the critic's value update (ppo)."""
    off_policy_correction: OffPolicyCorrection | None = None
    """--off-policy-correction: tis, icepop or mis weights between train and rollout log-probs."""
    tis_clip_low: float = 0.0
    """--tis-clip-low: lower truncation of TIS weights."""
    tis_clip_high: float = 2.0
    """--tis-clip-high: upper truncation of TIS weights (also IcePop's upper bound and MIS's
    sequence-ratio ceiling)."""
    icepop_low: float = 0.5
    """--icepop-low: IcePop masks tokens whose ratio falls below this."""
    mis_veto_threshold: float = 1e-4
    """--mis-veto-threshold: MIS drops a whole sample if any token ratio falls below this."""

    def __post_init__(self) -> None:
        self.eps_clip_high = self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
        self._check_choices()
        estimator = self._check_custom_paths()
        self._check_ranges()
        self._check_kl(estimator)
        self._check_estimator_specific(estimator)

    def _check_choices(self) -> None:
        for flag, value, choices in (
            ("--advantage-estimator", self.advantage_estimator, registry.estimator_names()),
            ("--loss-type", self.loss_type, registry.loss_names()),
            ("--loss-reduction", self.loss_reduction, get_args(LossReduction)),
            ("--kl-loss-type", self.kl_loss_type, KL_TYPES),
        ):
            if value not in choices:
                raise ValueError(f"{flag} {value!r} is not one of {', '.join(choices)}")
        corrections = get_args(OffPolicyCorrection)
        if self.off_policy_correction is not None and self.off_policy_correction not in corrections:
            raise ValueError(
                f"--off-policy-correction {self.off_policy_correction!r} is not one of {', '.join(corrections)}"
            )

    def _check_custom_paths(self) -> registry.EstimatorSpec:
        for flag, path, choice, value, chosen in (
            (
                registry.CUSTOM_LOSS_FLAG, self.custom_loss_function_path,
                f"--loss-type {registry.CUSTOM_LOSS}", self.loss_type, registry.CUSTOM_LOSS,
            ),
            (
                registry.CUSTOM_ESTIMATOR_FLAG, self.custom_advantage_function_path,
                f"--advantage-estimator {registry.CUSTOM_ESTIMATOR}", self.advantage_estimator,
                registry.CUSTOM_ESTIMATOR,
            ),
        ):  # fmt: skip
            if value == chosen and path is None:
                raise ValueError(f"{choice} needs {flag} 'package.module:function'")
            if path is not None and value != chosen:
                raise ValueError(
                    f"{flag} {path!r} is only used with {choice}, not {value!r}; set {choice} "
                    f"or drop {flag}"
                )
            if path is not None:
                split_import_path(path, flag)
        # Loaded here, on the driver, so a wrong path or spec fails before anything starts.
        registry.loss_spec(self)
        return registry.estimator_spec(self)

    def _check_ranges(self) -> None:
        if not 0 <= self.eps_clip < 1 or self.eps_clip_high < 0:
            raise ValueError(
                f"--eps-clip ({self.eps_clip}) must be in [0, 1) and --eps-clip-high "
                f"({self.eps_clip_high}) >= 0; typical values are 0.2 and 0.28"
            )
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c ({self.eps_clip_c}) must be > 1 (dual clip, e.g. 3.0)")
        if self.entropy_coef < 0:
            raise ValueError(
                f"--entropy-coef ({self.entropy_coef}) must be >= 0; it weighs a bonus"
            )
        if not 0 <= self.tis_clip_low <= 1 <= self.tis_clip_high:
            raise ValueError(
                f"--tis-clip-low ({self.tis_clip_low}) and --tis-clip-high ({self.tis_clip_high}) "
                "must satisfy 0 <= low <= 1 <= high"
            )
        if not 0 < self.icepop_low <= 1 or not 0 < self.mis_veto_threshold < 1:
            raise ValueError(
                f"--icepop-low ({self.icepop_low}) must be in (0, 1] and --mis-veto-threshold "
                f"({self.mis_veto_threshold}) in (0, 1)"
            )
        if self.loss_reduction == "constant":
            if self.loss_constant_normalizer is None or self.loss_constant_normalizer < 1:
                raise ValueError(
                    "--loss-reduction constant needs --loss-constant-normalizer >= 1 (e.g. the "
                    f"max response length), got {self.loss_constant_normalizer}"
                )
        elif self.loss_constant_normalizer is not None:
            raise ValueError(
                f"--loss-constant-normalizer ({self.loss_constant_normalizer}) only applies to "
                f"--loss-reduction constant, not {self.loss_reduction}; drop it or switch the reduction"
            )

    def _check_kl(self, estimator: registry.EstimatorSpec) -> None:
        if self.use_kl_loss and self.kl_loss_coef <= 0:
            raise ValueError(
                f"--use-kl-loss with --kl-loss-coef {self.kl_loss_coef} adds nothing to the loss but "
                "still runs the reference model; set --kl-loss-coef > 0 or drop --use-kl-loss"
            )
        if not self.use_kl_loss and self.kl_loss_coef != 0:
            raise ValueError(
                f"--kl-loss-coef {self.kl_loss_coef} has no effect without --use-kl-loss; add it"
            )
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef ({self.kl_coef}) must be >= 0")
        if self.kl_coef and not estimator.token_rewards:
            token_reward_estimators = [n for n, e in registry.ESTIMATORS.items() if e.token_rewards]
            raise ValueError(
                f"--kl-coef {self.kl_coef} would be ignored by --advantage-estimator "
                f"{self.advantage_estimator}, which uses one reward per sample; use --use-kl-loss "
                f"--kl-loss-coef {self.kl_coef} instead, or an estimator among "
                f"{', '.join(token_reward_estimators)}"
            )

    def _check_estimator_specific(self, estimator_spec: registry.EstimatorSpec) -> None:
        estimator = self.advantage_estimator
        if self.gamma != 1.0 and not estimator_spec.discounting:
            discounting = [n for n, e in registry.ESTIMATORS.items() if e.discounting]
            raise ValueError(
                f"--gamma {self.gamma} is ignored by --advantage-estimator {estimator}; it applies "
                f"to {', '.join(discounting)}"
            )
        if self.lambd != 1.0 and estimator != "ppo":
            raise ValueError(
                f"--lambd {self.lambd} is GAE's lambda and only applies to ppo, not {estimator}"
            )
        if not self.grpo_std_normalization and estimator not in ("grpo", "gspo"):
            raise ValueError(
                f"--no-grpo-std-normalization only applies to grpo and gspo, not {estimator}"
                + (" (dr_grpo never divides by the std)" if estimator == "dr_grpo" else "")
            )
        if estimator == "dr_grpo" and self.loss_reduction == "sample_mean":
            raise ValueError(
                "--advantage-estimator dr_grpo removes the per-sample length normalization that "
                "--loss-reduction sample_mean applies; use --loss-reduction constant with "
                "--loss-constant-normalizer (e.g. the max response length)"
            )
        if self.loss_type == "sft_loss" and (self.off_policy_correction or self.use_kl_loss):
            raise ValueError(
                "--loss-type sft_loss ignores --off-policy-correction and --use-kl-loss; drop them"
            )
