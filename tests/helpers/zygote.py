"""Start ``python -m checkpointless ...`` launchers by forking an interpreter that imported torch once.

Why: every job a test runs starts a launcher, and the launcher a fork-server template that
imports torch and ``torch._dynamo`` before the first worker can exist: about 5 s of CPU each on
the 2-core CI machines, for some 240 jobs in ``make test``, close to half of the suite's CPU.
Here each test process (each pytest-xdist worker) keeps one "zygote" that paid those imports
once. A launch forks it: the child becomes the launcher (``checkpointless.cli.main``), and
before the launcher starts any thread it forks its template from itself
(``checkpointless.launcher.forkserver.prefork``), so the template is ready at once. What the
job then does, from the coordinator to the workers forked from the template, is the launcher's
own code, unchanged.

A launch falls back to a fresh interpreter (``subprocess.Popen``, as before) when the zygote
could differ from one: a variable differs from the zygote's environment that the zygote's
imports might read (``PYTHONPATH``, ``TORCH*``, ``OMP_*`` are read at import time; ours, pytest's,
and Hugging Face's, which only packages the zygote never imports read, are not), the command is not
``<this python> -m checkpointless``, or ``CHECKPOINTLESS_TEST_ZYGOTE=0`` is set.

Each launch is watched by a small process forked from the zygote (the launcher's parent). It
sends the launcher's pid and then its exit status over a socket that only the test holds, which
gives the test a handle with the part of ``Popen``'s interface the tests use. The launcher leads
a session of its own, like ``Popen(start_new_session=True)``, so ``os.killpg(pid, ...)`` works.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, NoReturn, Protocol

__all__ = ["ENABLE_ENV", "Process", "ZygoteProcess", "launch"]

ENABLE_ENV = "CHECKPOINTLESS_TEST_ZYGOTE"  # "0": fresh interpreters; unset or "1": the zygote
_MAX_REQUEST = 1 << 20  # argv + environment, as one SOCK_SEQPACKET message
_READY_S = 120.0  # the zygote's imports, on a loaded machine


class Process(Protocol):
    """What the tests use of a launcher process, whether Popen or ZygoteProcess."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | Any: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...


class ZygoteProcess:
    """A launcher forked from the zygote: its status comes from its watcher, over ``sock``."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._sock = sock
        self._buf = b""

    def _read(self, timeout: float | None) -> None:
        """Take what the watcher sent within ``timeout`` s (0: only what is there now)."""
        self._sock.settimeout(timeout)
        try:
            chunk = self._sock.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the watcher is gone without a status: it was killed, and so is its launcher
            self.returncode = -signal.SIGKILL if self.returncode is None else self.returncode
            return
        self._buf += chunk
        for line in self._buf.split(b"\n")[:-1]:
            msg = json.loads(line)
            if "exit" in msg:
                self.returncode = int(msg["exit"])
        self._buf = self._buf.rsplit(b"\n", 1)[-1]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout or 0.0)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.close()


class _Zygote:
    """The test process's side: the zygote's process and the socket requests go over."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # stdin and stdout are not the test process's: under pytest-xdist they are its channel
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.zygote", str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        theirs.close()
        self.sock.settimeout(_READY_S)
        try:
            self.ready = self.sock.recv(64) == b"ready"
        except OSError:
            self.ready = False
        self.lock = threading.Lock()

    def launch(
        self, cmd: list[str], cwd: str, env: dict[str, str], out: int, netns: str | None
    ) -> ZygoteProcess | None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = json.dumps({"argv": cmd, "cwd": cwd, "env": env, "netns": netns}).encode()
        try:
            with self.lock:
                self.sock.settimeout(10.0)
                socket.send_fds(self.sock, [request], [theirs.fileno(), out])
            theirs.close()
            mine.settimeout(30.0)
            line = b""
            while not line.endswith(b"\n"):
                chunk = mine.recv(4096)
                if not chunk:
                    raise OSError("the zygote closed the launch")
                line += chunk
        except OSError:
            theirs.close()
            mine.close()
            return None
        first, _, rest = line.partition(b"\n")
        msg = json.loads(first)
        if "pid" not in msg:
            mine.close()
            return None  # a fallback: the message says why
        proc = ZygoteProcess(int(msg["pid"]), mine)
        proc._buf = rest
        return proc


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def launch(
    cmd: list[str], cwd: str, env: Mapping[str, str], out: int, netns: str | None = None
) -> ZygoteProcess | None:
    """Start ``cmd`` (``[sys.executable, "-m", "checkpointless", ...]``) from the zygote with
    stdout and stderr on the descriptor ``out``, inside the network namespace ``netns`` if given
    (as ``ip netns exec`` would); None where a fresh interpreter must do it."""
    global _zygote
    if os.environ.get(ENABLE_ENV, "1") != "1" or cmd[:3] != [sys.executable, "-m", "checkpointless"]:
        return None
    with _zygote_lock:
        if _zygote is None or _zygote.popen.poll() is not None:
            if _zygote is not None and not _zygote.ready:
                return None  # it could not start once: it will not now
            _zygote = _Zygote()
        zygote = _zygote
    if not zygote.ready:
        return None
    return zygote.launch(cmd, cwd, dict(env), out, netns)


# -- the zygote's side --------------------------------------------------------------------------
# Variables no import of the zygote's reads: ours and pytest's (``PYTEST_CURRENT_TEST`` changes
# with every test) are read at run time; Hugging Face's (``HF_HUB_OFFLINE``, the HF test scripts'
# own) are read by transformers and accelerate, which a job's workers import themselves. Without
# them every Hugging Face job paid the launcher's and the template's torch imports afresh.
_NOT_READ_AT_IMPORT = ("CHECKPOINTLESS_", "PYTEST_", "HF_", "TRANSFORMERS_")


def _differs(env: Mapping[str, str], base: Mapping[str, str]) -> str | None:
    """The first variable that ``env`` sets otherwise than ``base`` and that an import of the
    zygote's might read (see ``_NOT_READ_AT_IMPORT``)."""
    for key in sorted(set(env) | set(base)):
        if not key.startswith(_NOT_READ_AT_IMPORT) and env.get(key) != base.get(key):
            return key
    return None


def _enter_netns(name: str) -> None:
    """Join the network namespace ``name``, as ``ip netns exec`` does before it execs (its
    private /sys and /etc/netns files are not needed here: nothing the job runs reads them)."""
    import ctypes

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _launcher(req: dict[str, Any], out: int) -> NoReturn:
    """In the launcher's process: become ``python -m checkpointless ARGS`` and leave with its status."""
    import atexit
    import random
    import traceback

    code = 1
    try:
        if req.get("netns"):
            _enter_netns(str(req["netns"]))
        import numpy as np

        from checkpointless.cli import main
        from checkpointless.launcher.forkserver import ForkServerError, prefork

        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.path[0] = os.getcwd()  # what ``python -m`` puts first: where it was started
        random.seed()  # a fresh interpreter seeds from the OS; every fork would draw the same
        np.random.seed()
        args = list(req["argv"][3:])
        sys.argv = [
            os.path.join(os.path.dirname(sys.modules["checkpointless"].__file__ or ""), "__main__.py")
        ]
        sys.argv += args
        if args[:1] in (["run"], ["agent"]):  # the commands that start an agent
            with contextlib.suppress(ForkServerError):  # then the launcher starts one itself
                prefork()
        code = main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # what the interpreter's end would do for the launcher, without tearing torch down (~1 s)
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        if code < 0:  # as a fresh interpreter that died of the signal would end
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _watch(req: dict[str, Any], reply: int, out: int, server: socket.socket) -> NoReturn:
    """In the watcher (the launcher's parent): start it, send its pid, then its exit status."""
    try:
        server.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote ignores it; we wait
        pid = os.fork()
        if pid == 0:
            os.close(reply)
            _launcher(req, out)
        os.close(out)
        os.write(reply, json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.write(reply, json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:
        os._exit(0)


def main() -> NoReturn:
    import ctypes
    import gc

    server = socket.socket(fileno=int(sys.argv[1]))
    with contextlib.suppress(OSError):  # go with the test process, even if it is SIGKILLed
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the test process's
    # before the imports: torch._dynamo's sets TORCHINDUCTOR_CACHE_DIR in os.environ
    base = dict(os.environ)
    # the fork-server template's imports (checkpointless.launcher.forkserver.main), and the CLI's
    import numpy  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401

    import checkpointless.cli
    import checkpointless.comm.data_parallel
    import checkpointless.launcher.launcher
    import checkpointless.observe.hooks
    import checkpointless.recovery.job  # noqa: F401

    # every watcher is reaped by the kernel; the imported heap is never collected again, so the
    # forks share its pages instead of copying them when the collector touches them
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    gc.freeze()
    server.send(b"ready")
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(server, _MAX_REQUEST, 2)
        except OSError:
            break
        if not data:
            break  # the test process is gone
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        reply, out = fds
        req = json.loads(data)
        why = _differs(req["env"], base)
        if why is not None:
            with contextlib.suppress(OSError):
                os.write(reply, json.dumps({"fallback": f"{why} differs"}).encode() + b"\n")
        elif os.fork() == 0:
            _watch(req, reply, out, server)
        os.close(reply)
        os.close(out)
    os._exit(0)


if __name__ == "__main__":
    main()
