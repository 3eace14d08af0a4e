"""Stopping a run on SIGTERM or SIGINT: finish the step, checkpoint, stop everything, one line.

The first signal asks the loop to stop: the step in progress goes on, its checkpoint is saved (at
its save point, or after the step when the signal came later), and the loop ends. It has
--stop-grace-s for that; then, or at a second signal, the driver stops at once, without a new
checkpoint (the latest one stays whole: its pointer is written last). A signal during start-up
stops at once: nothing is trained yet. `miles train` exits with 128 + the signal's number.

Stopping "at once" raises `StopNow` in the main thread. It is a KeyboardInterrupt because Ray's
blocking calls end only on that one when a signal handler raises; `GracefulStop` keeps why.
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopNow(KeyboardInterrupt):
    """Raised in the main thread to stop at once; `GracefulStop.reason` says why."""


class GracefulStop:
    """The driver's stop state, set by its signal handlers and read by the loop."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signal: signal.Signals | None = None  # the first stop signal received
        self.reason: str | None = None  # why the stop became immediate, once it did
        self.running = False  # the loop runs: a stop can wait for a checkpoint
        self.rollout_id: int | None = None  # the rollout in progress, or the last one
        self.checkpoint: str | None = None  # the checkpoint the stop wrote
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended."""
        assert self.signal is not None, "no stop signal received"
        return 128 + int(self.signal)

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this (the main) thread from now on."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(
                sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler
            )
        if self._timer is not None:
            self._timer.cancel()

    def line(self, *, latest: str | None, save: str | None) -> str:
        """The one line `miles train` ends with: where it stopped and what it saved. `latest`:
        the newest complete checkpoint in `save` (--save) now."""
        sig = self.signal.name if self.signal is not None else "a signal"
        where = f"at rollout {self.rollout_id}" if self.running else "during start-up"
        head = f"miles train: stopped by {sig} {where}"
        if self.checkpoint is not None:
            return f"{head}; checkpoint {self.checkpoint} written"
        if self.reason is not None and self.running:
            head += f" at once ({self.reason})"
        if not save:
            return f"{head}; no checkpoint written (no --save)"
        if latest is None:
            return f"{head}; no checkpoint written, and {save} holds none yet"
        return f"{head}; no checkpoint written: the latest, {latest} in {save}, is intact"

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.signal is None:
            self.signal = sig
            if not self.running:
                self._stop_now("during start-up: nothing trained yet")
            self._timer = threading.Timer(self.grace_s, self._grace_over)
            self._timer.daemon = True
            self._timer.start()
            logger.warning(
                "%s: stopping after the step of rollout %s with a checkpoint, within "
                "--stop-grace-s %g s; send it again to stop at once, without one",
                sig.name, self.rollout_id, self.grace_s,
            )  # fmt: skip
            return
        if self.reason is None:  # the grace timer sets its reason before it interrupts
            self.reason = f"a second {sig.name}"
        self._stop_now(self.reason)

    def _grace_over(self) -> None:
        if self.reason is None:
            self.reason = f"--stop-grace-s {self.grace_s:g} s passed"
            _thread.interrupt_main(int(self.signal or signal.SIGTERM))

    def _stop_now(self, reason: str) -> None:
        self.reason = reason
        raise StopNow(reason)
