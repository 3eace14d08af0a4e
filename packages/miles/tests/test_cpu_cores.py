"""The cores a process can use: its affinity, capped by its cgroup's CPU quota (v2 or v1)."""

from __future__ import annotations

import os

import pytest

from miles.utils import cpu_cores
from miles.utils.cpu_cores import cgroup_cpu_quota


def _cgroup(tmp_path, files: dict[str, str], own: str = "0::/runner/job") -> tuple[str, str]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    membership = tmp_path / "self_cgroup"
    membership.write_text(own + "\n")
    return str(tmp_path), str(membership)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, None),  # no cgroup files: no limit known
        ({"cpu.max": "max 100000\n"}, None),
        ({"runner/job/cpu.max": "200000 100000\n", "cpu.max": "max 100000\n"}, 2.0),
        # the tightest limit on the way up counts, wherever it is set
        ({"runner/job/cpu.max": "max 100000\n", "runner/cpu.max": "150000 100000\n"}, 1.5),
        ({"runner/job/cpu.max": "400000 100000\n", "cpu.max": "100000 100000\n"}, 1.0),
        # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ],
)
def test_a_cgroup_cpu_quota_is_read_from_v2_or_v1(tmp_path, files, expected):
    root, membership = _cgroup(tmp_path, files)
    assert cgroup_cpu_quota(root, membership) == expected


def test_the_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.setattr(cpu_cores, "cgroup_cpu_quota", lambda: 2.5)
    assert cpu_cores.usable_cores() == 3  # a fraction of a CPU still runs a thread
    monkeypatch.setattr(cpu_cores, "cgroup_cpu_quota", lambda: None)
    assert cpu_cores.usable_cores() == 64
    monkeypatch.setattr(cpu_cores, "cgroup_cpu_quota", lambda: 0.5)
    assert cpu_cores.usable_cores() == 1
