"""Fault injection for multi-rank tests."""
from __future__ import annotations

import os
import signal
import time


def sigkill_at_step(n: int) -> None:
    """This process kills itself (SIGKILL, no cleanup) when it starts its n-th model step."""
    import wideep.engine.worker.runner as runner
    execute = runner.ModelRunner.execute
    steps = {"n": 0}

    def dying(self, batch, *args, **kw):
        steps["n"] += 1
        if steps["n"] == n:
            print(f"victim killed at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return execute(self, batch, *args, **kw)
    runner.ModelRunner.execute = dying
