"""The driver's stop state (`miles.utils.graceful_stop`) under real signals sent to this process:
the first asks for a stop, the second and the grace's end stop at once, a signal during start-up
stops at once; and the one line `miles train` ends with."""

from __future__ import annotations

import os
import signal
import time

import pytest

from miles.utils.graceful_stop import GracefulStop, StopNow


@pytest.fixture
def stop():
    state = GracefulStop(grace_s=30.0)
    state.install()
    yield state
    state.uninstall()


def _signal_self(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in this (main) thread at the next bytecode


def test_a_first_signal_asks_for_a_stop_and_a_second_stops_at_once(stop):
    stop.running, stop.rollout_id = True, 7
    _signal_self(signal.SIGTERM)
    assert stop.requested and stop.reason is None and stop.exit_code == 143
    with pytest.raises(StopNow):
        _signal_self(signal.SIGINT)
    assert stop.reason == "a second SIGINT" and stop.exit_code == 143  # the first one counts
    line = stop.line(latest="iter_0000005", save="/ckpt")
    assert line == (
        "miles train: stopped by SIGTERM at rollout 7 at once (a second SIGINT); no checkpoint "
        "written: the latest, iter_0000005 in /ckpt, is intact"
    )


def test_a_signal_during_start_up_stops_at_once(stop):
    with pytest.raises(StopNow):
        _signal_self(signal.SIGINT)  # a terminal's Ctrl-C
    assert stop.exit_code == 130
    assert stop.line(latest=None, save=None) == (
        "miles train: stopped by SIGINT during start-up; no checkpoint written (no --save)"
    )


def test_the_grace_period_ends_in_a_stop_at_once(stop):
    stop.grace_s, stop.running, stop.rollout_id = 0.2, True, 3
    _signal_self(signal.SIGTERM)
    with pytest.raises(StopNow):
        time.sleep(5)  # a step that outlasts the grace
    assert stop.reason == "--stop-grace-s 0.2 s passed"
    assert stop.line(latest=None, save="/ckpt") == (
        "miles train: stopped by SIGTERM at rollout 3 at once (--stop-grace-s 0.2 s passed); no "
        "checkpoint written, and /ckpt holds none yet"
    )


def test_a_stop_that_saved_names_its_checkpoint(stop):
    stop.running, stop.rollout_id = True, 7
    _signal_self(signal.SIGTERM)
    stop.checkpoint = "iter_0000007"
    assert stop.line(latest="iter_0000007", save="/ckpt") == (
        "miles train: stopped by SIGTERM at rollout 7; checkpoint iter_0000007 written"
    )
