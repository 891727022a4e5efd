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

from checkpointless.errors import CONFIG_ERROR_EXIT, ConfigError

__all__ = ["run_script"]

# what the coordinator is sent of a traceback: its end, where the error is, when it is long
_TRACEBACK_CHARS = 16_000


def _script_traceback(exc: BaseException) -> str:
    """``exc``'s traceback from the script's own frames on (this runner's and runpy's left out:
    they are the same in every job and say nothing about the error)."""
    import runpy
    import traceback

    runner = {__file__, runpy.__file__, "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in runner:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


def _report_config_error(text: str) -> bool:
    """Tell this worker's coordinator (if it has one) that the script ended on a ConfigError."""
    # only if the worker's recovery layer is loaded: a script that never called init() has no
    # coordinator link, and importing it here would cost an unadopted script torch's import
    process = sys.modules.get("checkpointless.recovery.process")
    if process is None:
        return False
    if len(text) > _TRACEBACK_CHARS:
        text = "...\n" + text[-_TRACEBACK_CHARS:]
    try:
        return bool(process.report_config_error(text))
    except Exception:  # the link is gone: print it here instead
        return False


def run_script(argv: list[str]) -> NoReturn:
    """Run ``argv[0]`` with ``sys.argv = argv`` as ``__main__``; exit with its status."""
    import faulthandler
    import runpy
    import traceback

    # a native crash (SIGSEGV, SIGABRT, ...) prints every thread's Python stack to the worker's
    # output: without it a crash inside torch or gloo leaves only an exit signal to go on
    faulthandler.enable(all_threads=True)
    # The launcher sets PYTHONUNBUFFERED so that a worker's output is not lost when it is killed,
    # but unbuffered, print() writes its text and its newline in two calls, and two ranks
    # printing at once interleave mid-line in the job's shared output ("...seen=20epoch metric
    # rank=0 ...\n\n"). Line buffering keeps that promptness for every whole line and writes each
    # line in one call, which a pipe or file keeps whole. A partial line waits for its newline, a
    # flush, or the exit below.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # replaced by something that cannot be reconfigured
            stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
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
    except ConfigError as e:
        # Deterministic: a replacement or a restart would raise it again, so the launcher ends
        # the job at once on this exit status. A connected worker's coordinator prints the
        # traceback, once for the job however many ranks raise it; otherwise it is printed here.
        code = CONFIG_ERROR_EXIT
        text = _script_traceback(e)
        if not _report_config_error(text):
            print(text, file=sys.stderr)
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
