"""The example job, except that the first spare SIGKILLs itself while it waits for a rank."""

from __future__ import annotations

import os
import runpy
import signal
import threading
import time
from pathlib import Path

if os.environ.get("CHECKPOINTLESS_ROLE") == "spare" and os.environ.get("CHECKPOINTLESS_WORKER_ID") == "3":

    def _die() -> None:
        time.sleep(6.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=_die, daemon=True).start()

runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"), run_name="__main__")
