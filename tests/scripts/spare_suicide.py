"""The example job, except that the first spare SIGKILLs itself as soon as it reports ready."""

from __future__ import annotations

import os
import runpy
import signal
from pathlib import Path
from typing import Any

if os.environ.get("CHECKPOINTLESS_ROLE") == "spare" and os.environ.get("CHECKPOINTLESS_WORKER_ID") == "3":
    import checkpointless.recovery.startup as startup_module

    class _DieWhenReady:
        """Stands in for the module's logger: passes everything on, and dies at 'ready'."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def info(self, msg: str, *args: Any) -> None:
            self._inner.info(msg, *args)
            if "waiting for a rank" in msg:
                os.kill(os.getpid(), signal.SIGKILL)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    startup_module.log = _DieWhenReady(startup_module.log)  # type: ignore[assignment]

runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"), run_name="__main__")
