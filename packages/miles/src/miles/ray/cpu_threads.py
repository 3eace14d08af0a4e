"""How many torch threads each train rank and engine runs on a CPU-only run.

Ray gives a 1-CPU actor OMP_NUM_THREADS=1, and the engine server inherits it: where the loop
alternates phases, one core per process idles in every phase. `decide_cpu_threads` (pure, tested
without Ray) gives the phase's processes the whole node instead; GPU runs keep torch's default.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray
from miles.config.placement_plan import PlacementPlan
from miles.utils.cpu_cores import usable_cores

logger = logging.getLogger(__name__)

USER_THREADS_ENV = "OMP_NUM_THREADS"
"""A value the user exported for the run wins over the decision: every process runs that many."""


@dataclass(frozen=True)
class CpuThreads:
    """Torch threads of every process of a run, in the placement plan's order."""

    train: tuple[int, ...]
    """Per policy train rank (the plan's `actor_bundles`)."""
    critic: tuple[int, ...]
    """Per rank of a critic on ranks of its own (`critic_bundles`)."""
    engines: tuple[int, ...]
    """Per rollout engine (`engine_bundles`)."""
    teachers: tuple[int, ...]
    """Per teacher engine of on-policy distillation (`teacher_bundles`)."""
    why: str
    """What decided it, for the log: "phases alternate", "phases overlap", or the user's
    OMP_NUM_THREADS."""

    def describe(self) -> str:
        """One log line, e.g. "cpu threads: train ranks 1 each, engines 2 each (phases
        alternate)"; a range where nodes differ."""
        parts = [
            f"{name} {_span(threads)} each"
            for name, threads in (
                ("train ranks", self.train + self.critic),
                ("engines", self.engines + self.teachers),
            )
            if threads
        ]
        return f"cpu threads: {', '.join(parts) or 'no process'} ({self.why})"


def decide_cpu_threads(
    plan: PlacementPlan,
    bundle_nodes: Sequence[str],
    node_cores: Mapping[str, int],
    *,
    phases_overlap: bool,
) -> CpuThreads:
    """Torch threads of each process, from where the placement put it.

    Phases alternate (neither --async-train nor --fully-async: the synchronous and the colocated
    loop): the train ranks of a node share all its cores while they train, and its engines
    share them while they generate, so a process gets `cores // processes of its phase on its
    node` (at least 1). A critic on ranks of its own trains in the train phase, and teacher
    engines score in the generation phase. Phases overlap (--async-train, --fully-async): both
    phases run at once, so each process keeps the CPUs reserved for its first bundle (rounded,
    at least 1) and none oversubscribes the others.

    `bundle_nodes`: the node of each logical bundle (`Placement.bundle_nodes`); `node_cores`:
    the cores processes on each node may use.
    """
    train_bundles = list(plan.actor_bundles) + list(plan.critic_bundles)
    engine_bundles = [bundles[0] for bundles in (*plan.engine_bundles, *plan.teacher_bundles)]

    def threads(bundles: list[int]) -> list[int]:
        if phases_overlap:
            return [max(1, round(plan.bundles[b].get("CPU", 1.0))) for b in bundles]
        sharing = Counter(bundle_nodes[b] for b in bundles)
        # A node missing from `node_cores` (gone since the placement) counts as one core.
        return [
            max(1, node_cores.get(bundle_nodes[b], 1) // sharing[bundle_nodes[b]]) for b in bundles
        ]

    train, engines = threads(train_bundles), threads(engine_bundles)
    num_actor, num_engines = plan.num_actor_ranks, plan.num_engines
    return CpuThreads(
        train=tuple(train[:num_actor]),
        critic=tuple(train[num_actor:]),
        engines=tuple(engines[:num_engines]),
        teachers=tuple(engines[num_engines:]),
        why="phases overlap" if phases_overlap else "phases alternate",
    )


def user_threads(plan: PlacementPlan, value: str) -> CpuThreads | None:
    """Every process runs the OMP_NUM_THREADS the user exported (`value`); None (with a
    warning) where it is no positive integer, which torch would not take either."""
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        logger.warning(
            "cpu threads: %s=%r is no positive integer; each process keeps what Ray gives it",
            USER_THREADS_ENV, value,
        )  # fmt: skip
        return None
    return CpuThreads(
        train=(threads,) * plan.num_actor_ranks,
        critic=(threads,) * plan.num_critic_ranks,
        engines=(threads,) * plan.num_engines,
        teachers=(threads,) * plan.num_teacher_engines,
        why=f"{USER_THREADS_ENV}={threads} from the environment, kept",
    )


def cpu_threads_for_run(
    plan: PlacementPlan,
    bundle_nodes: Sequence[str],
    *,
    phases_overlap: bool,
    has_gpus: bool,
    environ: Mapping[str, str] = os.environ,
) -> CpuThreads | None:
    """The run's decision, logged once: None on GPU runs (torch's default stays); the user's
    OMP_NUM_THREADS where the driver's `environ` has one; else `decide_cpu_threads` over the
    cores Ray's nodes offer (on the driver's own node, no more than the driver may use)."""
    if has_gpus:
        return None
    if USER_THREADS_ENV in environ:
        decision = user_threads(plan, environ[USER_THREADS_ENV])
    else:
        decision = decide_cpu_threads(
            plan, bundle_nodes, _node_cores(), phases_overlap=phases_overlap
        )
    if decision is not None:
        logger.info(decision.describe())
    return decision


def _node_cores() -> dict[str, int]:
    """Cores of each live Ray node: its CPU resource. On the driver's node also its CPU
    affinity, which Ray's workers inherit: a local instance may offer more CPU slots than
    there are cores (`Run._join_ray`)."""
    cores = {
        node["NodeID"]: max(1, math.floor(node["Resources"].get("CPU", 1.0)))
        for node in ray.nodes()
        if node.get("Alive")
    }
    here = ray.get_runtime_context().get_node_id()
    if here in cores:
        cores[here] = min(cores[here], usable_cores())
    return cores


def _span(values: tuple[int, ...]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"
