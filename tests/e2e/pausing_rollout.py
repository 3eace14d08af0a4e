"""A rollout for the end-to-end runs that must be signalled at a given rollout: the built-in
single-turn rollout, which before rollout $MILES_TEST_PAUSE_AT writes $MILES_TEST_PAUSE_FILE and
waits (at most a minute) until the test removes it. Its samples are the built-in's."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from miles.rollout.single_turn import SingleTurnRollout

PAUSE_AT, PAUSE_FILE = "MILES_TEST_PAUSE_AT", "MILES_TEST_PAUSE_FILE"


class PausingRollout(SingleTurnRollout):
    async def generate_rollout(self, ctx, rollout_id):
        if str(rollout_id) == os.environ.get(PAUSE_AT):
            path = Path(os.environ[PAUSE_FILE])
            path.write_text(str(rollout_id))
            deadline = time.monotonic() + 60
            while path.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return await super().generate_rollout(ctx, rollout_id)
