"""Connecting the driver to Ray: join a cluster when given one, otherwise start a local one; and
the address the run's servers bind (`bind_host`).

Starting a local instance is explicit (`address="local"`): a bare `ray.init()` would silently join
whatever cluster was last started on the machine, which is someone else's job on a shared host.
A local instance is the driver's own (`miles.ray.local_ray`): deaf to the driver's signals,
stopped when the driver dies, and removed with its session directory by `stop_local_ray`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from urllib.parse import urlsplit

import ray
from miles.ray.local_ray import start_local_ray
from miles.utils.loopback import is_loopback

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def _keep_workers_in_this_environment() -> None:
    """Under `uv run`, Ray rebuilds the project's virtual environment in every worker from an
    uploaded copy of the working directory (tens of seconds per start, and a second install that
    can drift from the first). miles's workers share the driver's environment instead, as they do
    without uv. Ray reads RAY_ENABLE_UV_RUN_RUNTIME_ENV when it is first imported, so the setting
    is also applied to the already-imported constant; a user's explicit value wins."""
    if os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0") != "0":
        return
    from ray._private import ray_constants

    if hasattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV"):
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False


def init_ray(
    address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = True
) -> None:
    """Connect this process to Ray; a no-op when it already is.

    `address` (or $RAY_ADDRESS) joins an existing cluster, e.g. "10.0.0.1:6379" or "auto".
    Without either, a local single-node instance starts in-process with `num_cpus` CPUs
    (None: all of them). `num_cpus` belongs to the cluster's nodes when joining, so it is ignored.
    """
    if ray.is_initialized():
        logger.info("ray already initialized; keeping the existing connection")
        return
    _keep_workers_in_this_environment()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        if num_cpus is not None:
            logger.info(
                "init_ray: num_cpus=%d ignored when joining the cluster at %s; the nodes' own "
                "`ray start --num-cpus` decides",
                num_cpus, address,
            )  # fmt: skip
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=log_to_driver)
        return
    logger.info("starting a local Ray instance (num_cpus=%s)", num_cpus)
    start_local_ray(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=log_to_driver,
    )


def bind_host(external_engine_urls: Iterable[str] = ()) -> str | None:
    """Where the run's engines and train ranks listen and are reached: loopback (`LOOPBACK`)
    when the whole Ray cluster is one node, so nothing of the run is exposed on the machine's
    network; None (each node's own address) with several nodes, or when an external engine
    elsewhere must reach trainer rank 0 for the weight updates."""
    alive = [node for node in ray.nodes() if node.get("Alive")]
    if len(alive) != 1:
        return None
    if not all(is_loopback(urlsplit(url).hostname or "") for url in external_engine_urls):
        return None
    return LOOPBACK
