"""Where train ranks and rollout engines run: one Ray placement group for the whole job.

`plan_placement` is a pure function of the config (which bundle each rank and engine uses), so the
layout is tested without Ray. `create_placement` reserves the bundles and, once Ray has put them on
nodes, maps the plan's logical bundles onto physical ones so train ranks fill whole nodes first.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from miles.config.placement_plan import (
    FEWER_OR_MORE,
    PlacementPlan,
    plan_for_cluster,
    plan_for_run,
    plan_placement,
)
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

if TYPE_CHECKING:
    from miles.config.miles_config import MilesConfig

__all__ = [
    "Placement",
    "PlacementPlan",
    "create_placement",
    "plan_for_cluster",
    "plan_for_config",
    "plan_for_run",
    "plan_placement",
    "remove_placement",
]

logger = logging.getLogger(__name__)


@dataclass
class Placement:
    """A ready placement group, with the plan's logical bundles mapped onto physical ones."""

    group: PlacementGroup
    plan: PlacementPlan
    bundle_nodes: list[str]
    """Node id of each logical bundle index."""
    bundle_indices: list[int]
    """Physical bundle index in `group` of each logical bundle index."""
    bundle_devices: list[str] | None = None
    """The GPU id (on its node) of each logical bundle; None when the bundles hold no GPUs."""
    bind_host: str | None = None
    """The address every engine and train rank binds (`cluster.bind_host`: loopback on one
    node); None: each node's own address."""

    def actor_scheduling(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy that puts train rank `rank` on its bundle."""
        return self._strategy(self.plan.actor_bundles[rank])

    def engine_scheduling(self, engine: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy for rollout engine `engine`: its first bundle. A multi-device
        engine is one process that drives the devices of all its bundles."""
        return self._strategy(self.plan.engine_bundles[engine][0])

    def engine_devices(self, engine: int) -> list[str] | None:
        """GPU ids (on its node) of every bundle of engine `engine`: what its server must see.
        Ray shows an actor only its own bundle's GPU; a multi-GPU engine needs all of them."""
        if self.bundle_devices is None:
            return None
        return [self.bundle_devices[b] for b in self.plan.engine_bundles[engine]]

    def critic_scheduling(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy for rank `rank` of a critic on ranks of its own."""
        return self._strategy(self.plan.critic_bundles[rank])

    def teacher_scheduling(self, teacher: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy for teacher engine `teacher` (--use-opd): its first bundle."""
        return self._strategy(self.plan.teacher_bundles[teacher][0])

    def teacher_devices(self, teacher: int) -> list[str] | None:
        """GPU ids (on its node) of every bundle of teacher engine `teacher`."""
        if self.bundle_devices is None:
            return None
        return [self.bundle_devices[b] for b in self.plan.teacher_bundles[teacher]]

    def actor_node(self, rank: int) -> str:
        return self.bundle_nodes[self.plan.actor_bundles[rank]]

    def engine_node(self, engine: int) -> str:
        return self.bundle_nodes[self.plan.engine_bundles[engine][0]]

    def _strategy(self, logical: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.bundle_indices[logical],
        )


def plan_for_config(config: MilesConfig, *, use_gpus: bool) -> PlacementPlan:
    """The run's plan (`plan_for_run`) from its whole configuration."""
    return plan_for_run(
        config.cluster, config.distillation, use_gpus=use_gpus, critic=config.critic
    )


def create_placement(
    plan: PlacementPlan,
    *,
    timeout_s: float = 600.0,
    log_every_s: float = 10.0,
    name: str | None = None,
    bind_host: str | None = None,
) -> Placement:
    """Reserve the plan's bundles (strategy PACK) and map them onto nodes; `bind_host` is
    recorded for the processes placed in them (`Placement.bind_host`).

    While Ray waits for resources, logs what is needed and what the cluster has every
    `log_every_s`. On timeout the group is removed and TimeoutError says both and the fix.
    """
    needed = plan.total_resources()
    logger.info("placement: reserving %d bundles (%s)", len(plan.bundles), _fmt(needed))
    group = ray.util.placement_group(plan.bundles, strategy="PACK", name=name or "")
    ready = group.ready()
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        done, _ = ray.wait([ready], timeout=max(0.0, min(log_every_s, timeout_s - waited)))
        if done:
            break
        waited = time.monotonic() - start
        have = _cluster_summary()
        if waited >= timeout_s:
            ray.util.remove_placement_group(group)
            raise TimeoutError(
                f"placement group of {len(plan.bundles)} bundles ({_fmt(needed)}) not ready "
                f"after {timeout_s:.0f}s; {have}; {FEWER_OR_MORE}"
            )
        logger.warning(
            "placement: waited %.0fs for %d bundles (%s); %s",
            waited, len(plan.bundles), _fmt(needed), have,
        )  # fmt: skip
    ray.get(ready)
    physical_nodes = _bundle_nodes(group, len(plan.bundles))
    bundle_indices = _logical_to_physical(plan, physical_nodes)
    devices = _bundle_gpu_ids(group, len(plan.bundles)) if "GPU" in needed else None
    placement = Placement(
        group=group,
        plan=plan,
        bundle_nodes=[physical_nodes[i] for i in bundle_indices],
        bundle_indices=bundle_indices,
        bundle_devices=[devices[i] for i in bundle_indices] if devices else None,
        bind_host=bind_host,
    )
    _warn_split_engines(placement)
    logger.info(
        "placement ready: train ranks on %d node(s), engines on %d node(s)",
        len({placement.actor_node(r) for r in range(plan.num_actor_ranks)}),
        len({placement.engine_node(e) for e in range(plan.num_engines)}),
    )
    return placement


def remove_placement(placement: Placement) -> None:
    """Release the group's resources (actors scheduled into it are killed by Ray)."""
    ray.util.remove_placement_group(placement.group)


def _bundle_nodes(group: PlacementGroup, num_bundles: int) -> list[str]:
    table = ray.util.placement_group_table(group)["bundles_to_node_id"]
    nodes = [table.get(i, table.get(str(i))) for i in range(num_bundles)]
    assert all(nodes), f"ready placement group has bundles without a node: {table}"
    return nodes


@ray.remote(num_cpus=0)
def _visible_gpu_ids() -> list[str]:
    return [str(i) for i in ray.get_gpu_ids()]


def _bundle_gpu_ids(group: PlacementGroup, num_bundles: int) -> list[str]:
    """The GPU id Ray gave each physical bundle (one GPU each), asked from inside the bundle."""
    probes = [
        _visible_gpu_ids.options(
            num_gpus=0.01,  # a sliver of the bundle's GPU: Ray reports that GPU's id
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        ).remote()
        for i in range(num_bundles)
    ]
    ids = ray.get(probes, timeout=120)  # a one-line task per bundle, already placed
    assert all(len(found) == 1 for found in ids), f"bundles of one GPU reported GPU ids {ids}"
    return [found[0] for found in ids]


def _logical_to_physical(plan: PlacementPlan, nodes: list[str]) -> list[int]:
    """Physical bundle index of each logical one.

    Colocated: sorted by (node id, physical index), deterministic and node-contiguous.
    Disaggregated: train ranks take bundles from the nodes holding the most bundles first (ties by
    node id), so they span as few nodes as possible; engines get the rest, again node by node.
    Assumes the plan's actor bundles are 0..N-1 and the engines' the rest, as `plan_placement` makes.
    """
    if plan.colocate:
        return sorted(range(len(nodes)), key=lambda i: (nodes[i], i))
    counts = Counter(nodes)

    def by_fullest_node(indices: list[int]) -> list[int]:
        left = Counter(nodes[i] for i in indices)
        return sorted(indices, key=lambda i: (-left[nodes[i]], nodes[i], i))

    ordered = sorted(range(len(nodes)), key=lambda i: (-counts[nodes[i]], nodes[i], i))
    num_actor = plan.num_actor_ranks
    return ordered[:num_actor] + by_fullest_node(ordered[num_actor:])


def _warn_split_engines(placement: Placement) -> None:
    for engine, bundles in enumerate(placement.plan.engine_bundles):
        engine_nodes = {placement.bundle_nodes[b] for b in bundles}
        if len(engine_nodes) > 1:
            logger.warning(
                "rollout engine %d spans %d nodes; pick a --rollout-num-gpus-per-engine that "
                "divides the devices per node so each engine stays on one node",
                engine, len(engine_nodes),
            )  # fmt: skip


def _cluster_summary() -> str:
    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    return f"cluster has {nodes} node(s) with {_fmt(total)} in total, {_fmt(free)} available"


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in sorted(resources.items())) or "nothing"
