"""Endings no replacement can change, as pure functions: a situation in, the job's last words out.

Spares and restarts are for faults a new process does not meet again. Two endings are certain
to repeat, and each would otherwise burn every spare (or restart) before the fault budget
stopped the job with a misleading reason:

* :func:`config_error_verdict`: the script raised a :class:`~checkpointless.errors.ConfigError`
  (a setting that the library refuses), which every replacement raises again;
* :func:`unadopted_exit_verdict`: a process ended cleanly without ever calling
  ``checkpointless.init()``: a script that was never adopted, which should run with ``--plain``.

:func:`exit_verdict` reads a process exit for either. Each is unit-tested by feeding it a
situation (tests/unit/coordinator/test_fatal_rules.py).
"""

from __future__ import annotations

from checkpointless.errors import CONFIG_ERROR_EXIT

__all__ = ["config_error_verdict", "exit_verdict", "unadopted_exit_verdict"]

ADOPTION_DOC = "docs/adoption.md"


def config_error_verdict(who: str, traceback: str) -> str:
    """The job's end when ``who`` (e.g. "rank 1") raised a ConfigError; ``traceback`` is what it
    printed, or "" when it printed it itself. The first line names neither, so that the
    processes told to stop (each logs the first line) do not repeat the error N times."""
    head = (
        f"{who} stopped the job with a configuration error (a replacement would raise it again, "
        "so no spare or restart was used); fix the setting and start the job again"
    )
    body = traceback.strip()
    return f"{head}\n{body}" if body else f"{head} (its traceback is above)"


def unadopted_exit_verdict(who: str, script: str) -> str:
    """The job's end when ``who`` exited with code 0 without calling ``checkpointless.init()``."""
    return (
        f"{who} exited with code 0 without ever calling checkpointless.init(): {script or 'the script'} "
        "has not adopted checkpointless, so every exit looks like a fault to the launcher and "
        "spares would only train the whole job again. Run it with `checkpointless run --plain` "
        f"(the launcher alone, restarts on a fault), or adopt it ({ADOPTION_DOC})"
    )


def exit_verdict(who: str, code: int, ever_connected: bool, killed: bool, script: str) -> str | None:
    """Whether a process exit ends the job at once; the reason, or None (an ordinary fault).

    ``code``: its exit status (negative: a signal); ``ever_connected``: it said hello on a
    control connection (it called ``init()``); ``killed``: the coordinator had asked for its
    end (a hang verdict, a retired spare), so its status says nothing about the script."""
    if killed:
        return None
    if code == CONFIG_ERROR_EXIT:
        return config_error_verdict(who, "")
    if code == 0 and not ever_connected:
        return unadopted_exit_verdict(who, script)
    return None
