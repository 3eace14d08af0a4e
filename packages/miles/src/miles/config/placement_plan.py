"""The placement plan: which bundle each train rank and engine uses, a pure function of the flags.

Kept apart from `placement` (which reserves the bundles through Ray) so that reading and checking
the configuration never imports Ray. It reads the typed groups it is given (cluster, distillation),
never the whole `MilesConfig`: the configuration's checks call it, so it must not depend on them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.backends.training_utils.algorithms.critic_config import CriticConfig
    from miles.backends.training_utils.algorithms.distillation import DistillationConfig
    from miles.config.groups import ClusterConfig

COLOCATED_TRAIN_SHARE = 0.6
"""Share of a colocated bundle (its GPU and CPUs) the train actor takes."""
COLOCATED_ENGINE_SHARE = 1.0 - COLOCATED_TRAIN_SHARE
"""The rest goes to the engine: the two shares fill the bundle exactly."""

FEWER_OR_MORE = (
    "use fewer --actor-num-nodes / --actor-num-gpus-per-node / --rollout-num-gpus, "
    "or add nodes to the Ray cluster"
)


@dataclass(frozen=True)
class PlacementPlan:
    """The job's bundles and who uses which; indices are logical (before node mapping)."""

    bundles: list[dict[str, float]]
    """Ray resources of each bundle: {"GPU": 1, "CPU": c} on GPU machines, {"CPU": c} without."""
    actor_bundles: list[int]
    """Bundle index of train rank r, for r in range(actor_num_nodes * actor_num_gpus_per_node)."""
    engine_bundles: list[list[int]]
    """Bundle indices of each rollout engine, rollout_num_gpus_per_engine of them each."""
    colocate: bool
    """Trainers and engines share the same bundles (they take turns via sleep / wake-up)."""
    teacher_bundles: list[list[int]] = field(default_factory=list)
    """Bundle indices of each teacher engine (--use-opd): always their own, after the others,
    since a teacher scores while the student's engines generate or sleep."""
    critic_bundles: list[int] = field(default_factory=list)
    """Bundle index of each rank of a critic on ranks of its own (--critic-num-nodes /
    --critic-num-gpus-per-node): its own, after the engines' (never shared with them: the
    critic is awake while they generate)."""

    @property
    def num_actor_ranks(self) -> int:
        return len(self.actor_bundles)

    @property
    def num_engines(self) -> int:
        return len(self.engine_bundles)

    @property
    def num_critic_ranks(self) -> int:
        return len(self.critic_bundles)

    @property
    def num_teacher_engines(self) -> int:
        return len(self.teacher_bundles)

    def total_resources(self) -> dict[str, float]:
        """What the whole group reserves, e.g. {"CPU": 4.0, "GPU": 4.0}."""
        total: Counter[str] = Counter()
        for bundle in self.bundles:
            total.update(bundle)
        return {key: float(value) for key, value in sorted(total.items())}


def plan_placement(
    *,
    actor_num_nodes: int,
    actor_num_gpus_per_node: int,
    rollout_num_gpus: int | None,
    rollout_num_gpus_per_engine: int,
    colocate: bool,
    use_gpus: bool,
    cpus_per_bundle: float = 1.0,
    teacher_engines: int = 0,
    teacher_gpus_per_engine: int = 1,
    critic_ranks: int = 0,
    external_engines: bool = False,
) -> PlacementPlan:
    """Lay out train ranks and rollout engines over bundles, one bundle per device.

    Colocated: the N = actor_num_nodes * actor_num_gpus_per_node train bundles also host the
    engines (rollout_num_gpus must be N; None means N). Disaggregated: N train bundles, then
    rollout_num_gpus engine bundles. Without GPUs a "GPU" is a worker device, i.e. a CPU bundle.
    The ranks of a critic of its own (`critic_ranks`) come next, then teacher engines (on-policy
    distillation), `teacher_gpus_per_engine` bundles each. `external_engines`: the engines run
    elsewhere (--rollout-external-engine-addrs), so none takes a bundle and `rollout_num_gpus`
    must be None. Every invalid combination raises ValueError naming the flags and the fix.
    """
    _check_positive("--actor-num-nodes", actor_num_nodes)
    _check_positive("--actor-num-gpus-per-node", actor_num_gpus_per_node)
    _check_positive("--rollout-num-gpus-per-engine", rollout_num_gpus_per_engine)
    num_actor = actor_num_nodes * actor_num_gpus_per_node
    if external_engines:
        if colocate or rollout_num_gpus is not None:
            raise ValueError(
                "--rollout-external-engine-addrs: engines the run does not launch take none of "
                "its devices; drop --colocate and --rollout-num-gpus"
            )
        rollout_num_gpus = 0
    elif rollout_num_gpus is None:
        if not colocate:
            raise ValueError(
                "--rollout-num-gpus is required without --colocate: the engines get their own "
                "devices; pass --rollout-num-gpus N, or --colocate to share the train devices"
            )
        rollout_num_gpus = num_actor
    if not external_engines:
        _check_positive("--rollout-num-gpus", rollout_num_gpus)
    if colocate and rollout_num_gpus != num_actor:
        raise ValueError(
            f"--colocate shares devices, so --rollout-num-gpus ({rollout_num_gpus}) must equal "
            f"--actor-num-nodes * --actor-num-gpus-per-node ({actor_num_nodes} * "
            f"{actor_num_gpus_per_node} = {num_actor}); pass --rollout-num-gpus {num_actor} or "
            "leave it unset, or drop --colocate to give the engines their own devices"
        )
    if rollout_num_gpus % rollout_num_gpus_per_engine:
        raise ValueError(
            f"--rollout-num-gpus ({rollout_num_gpus}) must be a multiple of "
            f"--rollout-num-gpus-per-engine ({rollout_num_gpus_per_engine}), since every engine "
            f"takes whole devices; use a multiple of {rollout_num_gpus_per_engine} or a "
            f"--rollout-num-gpus-per-engine that divides {rollout_num_gpus}"
        )
    if not cpus_per_bundle >= 0 or (not use_gpus and cpus_per_bundle == 0):
        raise ValueError(
            f"--cpus-per-bundle ({cpus_per_bundle}) must be > 0 without GPUs (the CPUs are the "
            "whole bundle) and >= 0 with them; pass a positive number such as 1"
        )

    bundle = {"GPU": 1.0} if use_gpus else {}
    if cpus_per_bundle > 0:
        bundle["CPU"] = float(cpus_per_bundle)
    engine_offset = 0 if colocate else num_actor
    num_bundles = num_actor if colocate else num_actor + rollout_num_gpus
    per = rollout_num_gpus_per_engine
    critic_bundles = list(range(num_bundles, num_bundles + critic_ranks))
    num_bundles += critic_ranks
    _check_positive("--opd-teacher-num-gpus-per-engine", teacher_gpus_per_engine)
    teacher_bundles = [
        list(range(num_bundles + t * teacher_gpus_per_engine,
                   num_bundles + (t + 1) * teacher_gpus_per_engine))
        for t in range(teacher_engines)
    ]  # fmt: skip
    num_bundles += teacher_engines * teacher_gpus_per_engine
    return PlacementPlan(
        bundles=[dict(bundle) for _ in range(num_bundles)],
        actor_bundles=list(range(num_actor)),
        engine_bundles=[
            list(range(engine_offset + e * per, engine_offset + (e + 1) * per))
            for e in range(rollout_num_gpus // per)
        ],
        colocate=colocate,
        teacher_bundles=teacher_bundles,
        critic_bundles=critic_bundles,
    )


def plan_for_run(
    cluster: ClusterConfig,
    distillation: DistillationConfig,
    *,
    use_gpus: bool,
    critic: CriticConfig | None = None,
) -> PlacementPlan:
    """The run's plan: the cluster's bundles, plus the teacher engines' with --use-opd and the
    ranks of a critic of its own."""
    teachers = distillation.opd_teacher_num_engines if distillation.use_opd else 0
    critic_ranks = 0
    if critic is not None and critic.on_own_ranks:
        nodes, per_node = critic.ranks(cluster.actor_num_nodes, cluster.actor_num_gpus_per_node)
        critic_ranks = nodes * per_node
    return plan_for_cluster(
        cluster,
        use_gpus=use_gpus,
        teacher_engines=teachers,
        teacher_gpus_per_engine=distillation.opd_teacher_num_gpus_per_engine,
        critic_ranks=critic_ranks,
    )


def plan_for_cluster(
    cluster: ClusterConfig,
    *,
    use_gpus: bool,
    teacher_engines: int = 0,
    teacher_gpus_per_engine: int = 1,
    critic_ranks: int = 0,
) -> PlacementPlan:
    """`plan_placement` for the placement flags of a `ClusterConfig` group (and teachers and a
    critic of its own); external engines take no bundle."""
    return plan_placement(
        actor_num_nodes=cluster.actor_num_nodes,
        actor_num_gpus_per_node=cluster.actor_num_gpus_per_node,
        rollout_num_gpus=cluster.rollout_num_gpus,
        rollout_num_gpus_per_engine=cluster.rollout_num_gpus_per_engine,
        colocate=cluster.colocate,
        use_gpus=use_gpus,
        cpus_per_bundle=cluster.cpus_per_bundle,
        teacher_engines=teacher_engines,
        teacher_gpus_per_engine=teacher_gpus_per_engine,
        critic_ranks=critic_ranks,
        external_engines=bool(cluster.rollout_external_engine_addrs),
    )


def _check_positive(flag: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} ({value!r}) must be a positive integer; pass 1 or more")
