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
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

if TYPE_CHECKING:
    from miles.config.groups import ClusterConfig

logger = logging.getLogger(__name__)

_FEWER_OR_MORE = (
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

    @property
    def num_actor_ranks(self) -> int:
        return len(self.actor_bundles)

    @property
    def num_engines(self) -> int:
        return len(self.engine_bundles)

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
) -> PlacementPlan:
    """Lay out train ranks and rollout engines over bundles, one bundle per device.

    Colocated: the N = actor_num_nodes * actor_num_gpus_per_node train bundles also host the
    engines (rollout_num_gpus must be N; None means N). Disaggregated: N train bundles, then
    rollout_num_gpus engine bundles. Without GPUs a "GPU" is a worker device, i.e. a CPU bundle.
    Every invalid combination raises ValueError naming the flags and the fix.
    """
    _check_positive("--actor-num-nodes", actor_num_nodes)
    _check_positive("--actor-num-gpus-per-node", actor_num_gpus_per_node)
    _check_positive("--rollout-num-gpus-per-engine", rollout_num_gpus_per_engine)
    num_actor = actor_num_nodes * actor_num_gpus_per_node
    if rollout_num_gpus is None:
        if not colocate:
            raise ValueError(
                "--rollout-num-gpus is required without --colocate: the engines get their own "
                "devices; pass --rollout-num-gpus N, or --colocate to share the train devices"
            )
        rollout_num_gpus = num_actor
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
    return PlacementPlan(
        bundles=[dict(bundle) for _ in range(num_bundles)],
        actor_bundles=list(range(num_actor)),
        engine_bundles=[
            list(range(engine_offset + e * per, engine_offset + (e + 1) * per))
            for e in range(rollout_num_gpus // per)
        ],
        colocate=colocate,
    )


def plan_for_cluster(cluster: ClusterConfig, *, use_gpus: bool) -> PlacementPlan:
    """`plan_placement` for the placement flags of a `ClusterConfig` group."""
    return plan_placement(
        actor_num_nodes=cluster.actor_num_nodes,
        actor_num_gpus_per_node=cluster.actor_num_gpus_per_node,
        rollout_num_gpus=cluster.rollout_num_gpus,
        rollout_num_gpus_per_engine=cluster.rollout_num_gpus_per_engine,
        colocate=cluster.colocate,
        use_gpus=use_gpus,
        cpus_per_bundle=cluster.cpus_per_bundle,
    )


def _check_positive(flag: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} ({value!r}) must be a positive integer; pass 1 or more")


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

    def actor_node(self, rank: int) -> str:
        return self.bundle_nodes[self.plan.actor_bundles[rank]]

    def engine_node(self, engine: int) -> str:
        return self.bundle_nodes[self.plan.engine_bundles[engine][0]]

    def _strategy(self, logical: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.bundle_indices[logical],
        )


def create_placement(
    plan: PlacementPlan,
    *,
    timeout_s: float = 600.0,
    log_every_s: float = 10.0,
    name: str | None = None,
) -> Placement:
    """Reserve the plan's bundles (strategy PACK) and map them onto nodes.

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
                f"after {timeout_s:.0f}s; {have}; {_FEWER_OR_MORE}"
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
    ids = ray.get(probes)
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
