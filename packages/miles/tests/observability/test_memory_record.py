"""The memory record: a sampled process's short spike is caught (its peak is reset at each
sample, not sampled), and samples land in the loop phase they were taken in."""

from __future__ import annotations

import subprocess
import sys
import time

from miles.utils.observability import memory_record
from miles.utils.observability.memory_record import PhaseTimeline, phase_peaks
from miles.utils.observability.peak_rss import PeakRssSampler

MB = 1024 * 1024

# Holds ~200 MB for a blink (well under one sampling interval), then stays small.
SPIKE = (
    "import sys, time\n"
    "sys.stdin.readline()\n"
    "block = bytearray(200 * 1024 * 1024); del block\n"
    "print('done', flush=True)\n"
    "time.sleep(30)\n"
)


def test_a_spike_between_two_samples_is_caught_and_later_windows_do_not_repeat_it():
    child = subprocess.Popen([sys.executable, "-c", SPIKE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    sampler = PeakRssSampler(interval_s=5.0)  # no sample of its own during the spike
    sampler.start()
    try:
        sampler.watch("child", child.pid)
        before = sampler.drain()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        spike = sampler.drain()
        time.sleep(0.1)
        after = sampler.drain()
    finally:
        sampler.stop()
        child.kill()
        child.wait()
    assert before[0][0] == 0.0  # the first reading is the process's life so far
    assert max(values["child"] for _, values in spike) > 190 * MB
    assert max(values["child"] for _, values in after) < 100 * MB


def test_samples_fall_in_the_phase_of_their_window_and_make_the_record_and_metrics(tmp_path):
    timeline = PhaseTimeline(began_at=100.0)
    timeline.mark("generate", 0, at=110.0)
    timeline.mark("update weights", 0, at=120.0)
    samples = [
        (0.0, {"engine_0": 50 * MB}),  # before any phase: the start-up
        (110.2, {"engine_0": 300 * MB, "train_rank_0": 100 * MB}),
        (115.0, {"engine_0": 200 * MB, "train_rank_0": 120 * MB}),
        (120.0 - 1e-6, {"train_rank_0": 400 * MB}),  # the window closed at the phase change
        (121.0, {"train_rank_0": 500 * MB}),
    ]
    peaks = phase_peaks(samples, timeline)
    assert peaks == {
        ("engine_0", "startup"): 50 * MB,
        ("engine_0", "generate"): 300 * MB,
        ("train_rank_0", "generate"): 400 * MB,
        ("train_rank_0", "update_weights"): 500 * MB,
    }
    memory_record.append_record(tmp_path, memory_record.record_lines(0, peaks))
    lines = memory_record.read_record(tmp_path)
    assert {(line["process"], line["phase"]) for line in lines} == set(peaks)
    assert memory_record.rollout_metrics(peaks) == {
        "memory/engine_0/peak_rss_mb": 300.0,
        "memory/train_rank_0/peak_rss_mb": 500.0,
    }
