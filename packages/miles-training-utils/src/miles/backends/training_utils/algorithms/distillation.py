"""The settings of on-policy distillation (OPD), validated where they are built.

A teacher model scores the student's own samples token by token; the train step turns the
per-token reverse KL `log p_student - log p_teacher` into a penalty on the advantages (upstream
miles and slime) or into a loss term (`teacher_kl`), or, in `topk` mode, fits the student to the
teacher's top tokens at each position of those samples. The rollout side reads the teacher's
checkpoint, engine count and top-k, the train step the coefficient and the mode. No torch here:
the driver reads this group with the rest of the configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from miles.backends.training_utils.infra.checkpoint_paths import hf_checkpoint_dir

OPD_TYPES: dict[str, str] = {
    "sglang": "teacher engines (the reference engine on CPU, SGLang on GPUs) beside the student's",
}
"""--opd-type values this build runs, with what each means."""
_UPSTREAM_ONLY = {
    "megatron": "the teacher loaded inside the Megatron trainer",
    "self": "self-distillation with privileged context",
}

OpdKlMode = Literal["advantages", "loss", "topk"]
DEFAULT_OPD_TOP_K = 20


@dataclass(kw_only=True)
class DistillationConfig:
    """On-policy distillation: a teacher scores every response token the student samples."""

    use_opd: bool = False
    """--use-opd: score each sample's response tokens with a teacher model and pull the student
    towards it by the per-token reverse KL (log p_student - log p_teacher)."""
    opd_type: str = "sglang"
    """--opd-type: where the teacher runs; sglang: teacher engines (the reference engine on CPU,
    SGLang on GPUs) started beside the student's, scoring with prompt log-probs."""
    opd_teacher_checkpoint: str | None = None
    """--opd-teacher-checkpoint: Hugging Face checkpoint directory of the teacher; it must use
    the student's tokenizer (the teacher scores the student's token ids)."""
    opd_kl_coef: float = 1.0
    """--opd-kl-coef: weight of the teacher KL (advantages: A_t - coef * KL_t; loss: + coef x
    the reduced KL term)."""
    opd_kl_mode: OpdKlMode = "advantages"
    """--opd-kl-mode: advantages (upstream: the KL is subtracted from every token's advantage,
    after the estimator, and goes through the policy loss and its clipping), loss (an extra,
    unclipped loss term whose gradient is the reverse KL's policy gradient) or topk (an extra
    loss term: the forward KL from the teacher's --opd-top-k most likely tokens at each response
    position, sum_j p_teacher(j) (log p_teacher(j) - log p_student(j)); dense, so it also teaches
    a student whose samples the teacher rarely agrees with, such as a randomly initialised one)."""
    opd_top_k: int = DEFAULT_OPD_TOP_K
    """--opd-top-k: with --opd-kl-mode topk, how many of the teacher's most likely tokens it
    returns per position (SGLang's top_logprobs_num) and the student is fitted to."""
    opd_teacher_num_engines: int = 1
    """--opd-teacher-num-engines: teacher engines, each in its own placement bundles."""
    opd_teacher_num_gpus_per_engine: int = 1
    """--opd-teacher-num-gpus-per-engine: devices of one teacher engine (its tensor-parallel
    size; worker slots on CPU)."""

    def __post_init__(self) -> None:
        if self.opd_type not in OPD_TYPES:
            known = _UPSTREAM_ONLY.get(self.opd_type)
            what = f" ({known}) is not supported" if known else " is not an OPD type"
            supported = "; ".join(f"{name}: {doc}" for name, doc in OPD_TYPES.items())
            raise ValueError(f"--opd-type {self.opd_type}{what}; supported: {supported}")
        for flag, value in (
            ("--opd-teacher-num-engines", self.opd_teacher_num_engines),
            ("--opd-teacher-num-gpus-per-engine", self.opd_teacher_num_gpus_per_engine),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} ({value!r}) must be a positive integer; pass 1 or more")
        if not self.use_opd:
            self._refuse_unused_settings()
            return
        if isinstance(self.opd_top_k, bool) or not isinstance(self.opd_top_k, int):
            raise ValueError(f"--opd-top-k ({self.opd_top_k!r}) must be an integer; pass e.g. 20")
        if self.opd_kl_mode == "topk" and self.opd_top_k < 1:
            raise ValueError(
                f"--opd-top-k ({self.opd_top_k}) must be >= 1 with --opd-kl-mode topk: the "
                "student is fitted to that many of the teacher's tokens per position; pass e.g. 20"
            )
        if self.opd_kl_mode != "topk" and self.opd_top_k != DEFAULT_OPD_TOP_K:
            raise ValueError(
                f"--opd-top-k ({self.opd_top_k}) is only read with --opd-kl-mode topk (now "
                f"{self.opd_kl_mode}); add --opd-kl-mode topk or drop --opd-top-k"
            )
        if not self.opd_kl_coef > 0:
            raise ValueError(
                f"--opd-kl-coef ({self.opd_kl_coef}) must be > 0 with --use-opd: at 0 the "
                "teacher's scores are computed and never used; pass e.g. 1.0"
            )
        self.opd_teacher_checkpoint = _existing_checkpoint(self.opd_teacher_checkpoint)

    def _refuse_unused_settings(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in ("use_opd", "opd_type") and value != field.default:
                flag = "--" + field.name.replace("_", "-")
                raise ValueError(
                    f"{flag} ({value}) is only read with --use-opd; add it or drop {flag}"
                )

    @property
    def kl_in_advantages(self) -> bool:
        return self.use_opd and self.opd_kl_mode == "advantages"

    @property
    def kl_in_loss(self) -> bool:
        return self.use_opd and self.opd_kl_mode == "loss"

    @property
    def teacher_top_k(self) -> int:
        """Teacher tokens scored per response position: --opd-top-k in topk mode, else 0."""
        return self.opd_top_k if self.use_opd and self.opd_kl_mode == "topk" else 0


def _existing_checkpoint(path: str | None) -> str:
    """The teacher's checkpoint as an absolute directory (Ray workers run elsewhere); refused
    before start-up when it is missing or holds no config.json."""
    if not path:
        raise ValueError(
            "--use-opd needs the teacher: pass --opd-teacher-checkpoint DIR (a Hugging Face "
            "checkpoint directory using the student's tokenizer)"
        )
    return hf_checkpoint_dir("--opd-teacher-checkpoint", path)
