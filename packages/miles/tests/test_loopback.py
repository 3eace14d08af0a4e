"""One loopback test for where a run binds and how a train rank meets its peers."""

from __future__ import annotations

import pytest

from miles.utils.loopback import is_loopback


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "[::1]"]
)
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["10.0.0.7", "0.0.0.0", "::", "example.com", "localhost.example", ""]
)
def test_other_addresses(host):
    assert not is_loopback(host)
