"""The addresses of external rollout engines (--rollout-external-engine-addrs), and the cluster
settings refused with them.

A run given engines by address launches none and reserves no devices for them, so colocation and
the engines' device flags cannot be honoured; `ClusterConfig` refuses them where it is built. The
settings of other groups are refused with the checks across groups (`miles.config.external_engines`).
Kept apart from that module because `ClusterConfig` imports this one: it imports no config group.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

FLAG = "--rollout-external-engine-addrs"


def engine_url(addr: str) -> str:
    """The base URL of the engine at `addr` (`host:port`, or `http://host:port`); a ValueError
    naming the address otherwise."""
    text = addr.strip()
    parsed = urlsplit(text if "://" in text else f"http://{text}")
    example = "e.g. 127.0.0.1:30000 or http://engine-host:30000"
    try:
        port = parsed.port
    except ValueError:  # a port that is not a number, or out of range
        port = None
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or port is None
        or (parsed.path not in ("", "/") or parsed.query or parsed.fragment)
    ):
        raise ValueError(f"{FLAG}: {addr!r} is not an engine address host:port ({example})")
    host = parsed.hostname
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"{parsed.scheme}://{host}:{port}"


def check_cluster(
    addrs: list[str] | None,
    *,
    colocate: bool,
    rollout_num_gpus: int | None,
    rollout_num_gpus_per_engine: int,
    rollout_engine: str,
) -> None:
    """The addresses, and the cluster settings a run with external engines cannot honour
    (`ClusterConfig` calls this with its own fields when it is built)."""
    if not addrs:
        return
    given = f"{FLAG} ({' '.join(addrs)})"
    urls = [engine_url(addr) for addr in addrs]
    repeated = sorted({url for url in urls if urls.count(url) > 1})
    if repeated:
        raise ValueError(f"{given} names {', '.join(repeated)} more than once; name each engine "
                         "once")  # fmt: skip
    if colocate:
        raise ValueError(
            f"{given} with --colocate: colocated engines sleep while the trainer uses their "
            "devices, and a run must not put servers it did not launch to sleep; drop --colocate "
            f"(or drop {FLAG} and let the run launch colocated engines)"
        )
    refused = (
        ("--rollout-num-gpus", rollout_num_gpus, None,
         "the run reserves no devices for engines it did not launch"),
        ("--rollout-num-gpus-per-engine", rollout_num_gpus_per_engine, 1,
         "external engines have their own tensor-parallel size"),
        ("--rollout-engine", rollout_engine, "auto",
         "external engines are whatever serves at their addresses"),
    )  # fmt: skip
    for flag, value, default, why in refused:
        if value != default:
            raise ValueError(f"{flag} ({value}) with {given}: {why}, so it would be ignored; "
                             f"drop {flag}")  # fmt: skip
