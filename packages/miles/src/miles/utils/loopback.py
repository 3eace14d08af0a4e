"""Whether an address is this machine's loopback: the one test behind both the run's choice of
where to bind (`miles.ray.cluster.bind_host`) and a train rank's choice of rendezvous
(`miles.train_backend.train_actor`), so the two never disagree about an address."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`localhost`, any address of 127.0.0.0/8, or ::1 (brackets allowed); a host name other
    than localhost is not (resolving it could name any machine)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        return False
