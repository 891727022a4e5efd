"""Kill a process that writes files in a loop, at moments that land inside a write.

tests/e2e/test_durable.py (DCP checkpoints) and tests/e2e/test_snapshots.py (shared-memory
snapshots) check the same promise of their writers: a writer SIGKILLed mid-write leaves the last
published copy readable. Each attempt starts the writer loop afresh on the same folder, waits for
it to publish one copy (it prints a line), lets it run a moment longer (later attempts longer, so
the kills fall at different points of a write), kills it, and has the test check the folder. The
loop stops once two kills landed mid-write; the test then asserts at least one did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["kill_writer_repeatedly"]


def kill_writer_repeatedly(
    loop_code: str,
    folder: Path,
    *,
    attempts: int,
    pause: Callable[[int], float],
    mid_write: Callable[[list[str]], bool],
    check: Callable[[], None],
    enough: int = 2,
) -> int:
    """Run ``python -c loop_code folder`` up to ``attempts`` times, SIGKILLing it ``pause(attempt)``
    seconds after its first published copy; after each kill ``check()`` asserts on the folder.
    ``mid_write(names)`` says, from the folder's entries, whether the kill caught a write in
    flight. Returns how many kills did (stopping once ``enough`` have)."""
    landed = 0
    for attempt in range(attempts):
        proc = subprocess.Popen(
            [sys.executable, "-c", loop_code, str(folder)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # one copy is published
            time.sleep(pause(attempt))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        if mid_write(os.listdir(folder)):
            landed += 1
        check()
        if landed >= enough:
            break
    return landed
