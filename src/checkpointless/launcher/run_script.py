"""Run a script as ``__main__`` and leave with its exit status, without interpreter teardown.

Why not let the interpreter end normally: with torch 2.13, a gloo process group that outlives
the script (a DDP model still holds it after ``destroy_process_group``) keeps its worker threads,
and one of them may free the last collective's work while the interpreter is being torn down.
That work holds a Python object, the thread cannot take the GIL any more and is unwound, and
the process aborts (``terminate called without an active exception``, SIGABRT) after the script
has finished: on half of the runs of a 5-step DDP script under ``--plain`` (5 of 10), and seen
under torchrun as well. Here everything interpreter shutdown does for the script (join its
non-daemon threads, run its exit functions, flush) is done, and the process then ends at once
with the script's own status.

Used by every worker the fork server starts and, as ``python -m
checkpointless.launcher.run_script SCRIPT ARGS...``, by every process of ``--plain``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

__all__ = ["run_script"]


def run_script(argv: list[str]) -> NoReturn:
    """Run ``argv[0]`` with ``sys.argv = argv`` as ``__main__``; exit with its status."""
    import runpy
    import traceback

    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # a worker's fast exit (recovery/process.py) runs among the exit functions below and
        # would end the process with 0: tell it how the script ended
        process = sys.modules.get("checkpointless.recovery.process")
        if process is not None:
            process.note_exit_code(code)
        # what interpreter shutdown would do: join non-daemon threads, run atexit, flush
        with contextlib.suppress(Exception):
            import threading

            getattr(threading, "_shutdown", lambda: None)()
        with contextlib.suppress(Exception):
            import atexit

            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m checkpointless.launcher.run_script SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    run_script(sys.argv[1:])
