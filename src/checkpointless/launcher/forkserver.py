"""Start workers and spares by forking a template that has already imported torch.

Why: every new Python process pays ``import torch`` (and the lazy ``torch._dynamo`` import that
the first optimizer pulls in) before it can do anything: 3 to 6 s of CPU on a small machine, paid N
times at once at start-up, and again by every spare while the job trains next to it. A template
process pays it once; each worker or spare is then a ``fork`` of it, ready in milliseconds, and the
imported pages are shared copy-on-write. That makes start-up faster than N fresh interpreters, and
a spare that refills the pool after a swap costs the training ranks almost no CPU.

What makes forking safe here: the template only *imports*. It runs no torch operation, so no
OpenMP pool and no CUDA context exist to be broken by the fork (CUDA is initialised later, in the
worker); OpenBLAS, which numpy starts at import, re-creates its threads after a fork itself. Each
fork is a double fork: the intermediate process exits at once, so the worker is re-parented to
the launcher, which has made itself a child subreaper and can then wait for it like for any child
(exit status, signal) and be its parent for ``PR_SET_PDEATHSIG``.

The template talks to the launcher over a private ``socketpair`` (no port, no secret needed):
one JSON request per spawn with the descriptors the worker needs passed as ``SCM_RIGHTS``, one
JSON reply with the worker's pid.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from checkpointless.errors import CheckpointlessError

__all__ = ["ForkServer", "ForkedProcess", "become_subreaper", "prefork", "reap_strays", "take_preforked"]

_LEN = struct.Struct(">I")
_MAX_REQUEST = 1 << 20  # a request is argv + environment: far below this
_MAX_FDS = 8


class ForkServerError(CheckpointlessError):
    """The template could not start a process (the caller falls back to a fresh interpreter)."""


def become_subreaper() -> bool:
    """Make orphaned descendants (the template's forks) our children. False where unsupported."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except OSError:
        return False


def reap_strays(known: set[int]) -> None:
    """Reap zombie children we did not start ourselves (descendants re-parented to a subreaper,
    e.g. a dead worker's own helpers). Never touches ``known`` pids: those are waited by their
    owners, who need their exit status."""
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        try:
            pids = [int(x) for x in task.read_text().split()]
        except OSError:
            continue
        for pid in pids:
            if pid in known:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[-1].split()[0] == "Z"
            except OSError:
                continue
            if zombie:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)


class ForkedProcess:
    """A forked worker, with the subset of :class:`subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 0  # already reaped elsewhere: its status is lost
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                import subprocess

                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _send_msg(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([_LEN.pack(len(data)) + data], anc)


def _recv_msg(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message and the descriptors that came with it; None at EOF."""
    fds = array.array("i")
    head, anc, _, _ = sock.recvmsg(_LEN.size, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
    if not head:
        return None
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    while len(head) < _LEN.size:
        more = sock.recv(_LEN.size - len(head))
        if not more:
            return None
        head += more
    (n,) = _LEN.unpack(head)
    if n > _MAX_REQUEST:
        raise ForkServerError(f"fork-server message of {n} bytes")
    body = b""
    while len(body) < n:
        more = sock.recv(n - len(body))
        if not more:
            return None
        body += more
    return json.loads(body), list(fds)


class ForkServer:
    """The launcher's handle on the template process."""

    def __init__(self, python: str, env: dict[str, str], stdout: int | None) -> None:
        import subprocess

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.popen: subprocess.Popen[bytes] | ForkedProcess = subprocess.Popen(
            [python, "-m", "checkpointless.launcher.forkserver", str(theirs.fileno())],
            env=env,
            stdout=stdout,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.ready = False

    @classmethod
    def forked(cls, sock: socket.socket, pid: int) -> ForkServer:
        """A template forked from this process by :func:`prefork` (no interpreter started)."""
        fs = cls.__new__(cls)
        fs.sock, fs.popen, fs.ready = sock, ForkedProcess(pid), False
        return fs

    def wait_ready(self, timeout: float) -> bool:
        """Block until the template has imported everything (or died, or ``timeout``)."""
        if self.ready:
            return True
        self.sock.settimeout(timeout)
        try:
            got = _recv_msg(self.sock)
        except (OSError, ValueError, ForkServerError):
            got = None
        self.ready = got is not None and got[0].get("ready") is True
        return self.ready

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str, fds: dict[str, int], timeout: float = 10.0
    ) -> ForkedProcess:
        """Fork a process that runs ``argv[1:]`` (a script and its arguments) with ``env``.

        ``fds`` maps a role (``stdout``, ``stderr``, or an environment variable that should hold
        the descriptor's number in the child) to one of our descriptors, passed as SCM_RIGHTS.
        """
        if not self.ready or self.popen.poll() is not None:
            raise ForkServerError("the fork server is not running")
        roles = list(fds)
        self.sock.settimeout(timeout)
        try:
            _send_msg(
                self.sock, {"argv": argv, "env": env, "cwd": cwd, "fds": roles}, [fds[r] for r in roles]
            )
            reply = _recv_msg(self.sock)
        except (OSError, ValueError) as e:
            raise ForkServerError(f"fork server did not answer: {e}") from e
        if reply is None or not isinstance(reply[0].get("pid"), int):
            raise ForkServerError(f"fork server failed: {reply[0] if reply else 'closed'}")
        return ForkedProcess(reply[0]["pid"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()  # the template exits at EOF
        try:
            self.popen.wait(timeout=2)
        except Exception:
            self.popen.kill()  # stopped or wedged: SIGKILL works on a stopped process too
            self.popen.wait(timeout=5)


# -- the template's side ------------------------------------------------------------------------
def _run_child(req: dict[str, Any], fds: list[int], parent: int) -> None:
    """In the forked worker: become the script's process, run it, exit with its status."""
    import random

    from checkpointless.launcher.run_script import run_script

    # wait until the intermediate process has gone and we belong to the launcher, so that the
    # parent-death signal the worker sets up refers to the launcher, not to a process that exits
    deadline = time.monotonic() + 2.0
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.0005)
    env: dict[str, str] = req["env"]
    for role, fd in zip(req["fds"], fds, strict=True):
        if role == "stdout":
            os.dup2(fd, 1)
            os.close(fd)
        elif role == "stderr":
            os.dup2(fd, 2)
            os.close(fd)
        else:
            os.set_inheritable(fd, True)
            env[role] = str(fd)  # e.g. the key server's listening socket
    os.environ.clear()
    os.environ.update(env)
    os.chdir(req["cwd"])
    # a fresh interpreter seeds these from the OS; every fork would otherwise draw the same
    random.seed()
    with contextlib.suppress(Exception):
        import numpy as np

        np.random.seed()
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter has
    run_script(list(req["argv"][1:]))


def _serve(sock: socket.socket) -> None:
    while True:
        try:
            got = _recv_msg(sock)
        except (OSError, ValueError, ForkServerError):
            return
        if got is None:
            return  # the launcher is gone: so are we
        req, fds = got
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:  # the intermediate process
            os.close(r)
            worker = os.fork()
            if worker == 0:
                os.close(w)
                sock.close()
                # A session of its own, as torchrun gives each worker. Where the kernel groups
                # processes by session for scheduling (autogroup, on by default on many
                # distributions), ranks sharing the launcher's session compete as one group,
                # thread by thread, and each rank's gloo threads preempt its peers' training
                # threads: 3-5% longer steps for two ranks on two cores, measured with an
                # unchanged torch FSDP2 script under --plain against torchrun (BENCHMARKS.md).
                # Ctrl-C is the launcher's to handle either way (it stops the workers).
                os.setsid()
                _run_child(req, fds, os.getppid())
            os.write(w, str(worker).encode())
            os._exit(0)
        os.close(w)
        for fd in fds:
            os.close(fd)  # the worker has its copies
        pid_text = b""
        while chunk := os.read(r, 64):
            pid_text += chunk
        os.close(r)
        os.waitpid(middle, 0)
        try:
            _send_msg(sock, {"pid": int(pid_text)} if pid_text else {"error": "fork failed"})
        except OSError:
            return


# A template forked by prefork(), waiting for the launcher's agent to take it.
_preforked: ForkServer | None = None


def prefork() -> None:
    """Fork the template from this process now; the next :func:`take_preforked` returns it.

    For a process that has already imported torch and has one thread (a test harness's launcher
    forked from an interpreter that imported torch once): the template is then ready at once
    instead of paying the imports again. Called before the launcher starts any thread, because
    a fork copies only the calling thread and a lock another thread held would stay held.
    """
    global _preforked
    if "torch._dynamo" not in sys.modules or threading.active_count() != 1:
        raise ForkServerError("prefork() needs torch._dynamo imported and no thread but this one")
    parent = os.getpid()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            _template(theirs, parent)
        finally:
            os._exit(1)
    theirs.close()
    _preforked = ForkServer.forked(ours, pid)


def take_preforked() -> ForkServer | None:
    """The template :func:`prefork` made, once (None if there is none)."""
    global _preforked
    fs, _preforked = _preforked, None
    return fs


def main() -> NoReturn:
    _template(socket.socket(fileno=int(sys.argv[1])), os.getppid())


def _template(sock: socket.socket, launcher: int) -> NoReturn:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    with contextlib.suppress(OSError):  # die with the launcher, even if it is SIGKILLed
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != launcher:
        os._exit(0)  # it died before the line above: no signal will come
    # The expensive part, once. Nothing here may run a torch operation (see the module notes).
    import numpy  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (pulled in by the first optimizer: seconds)

    import checkpointless.comm.data_parallel
    import checkpointless.recovery.job  # noqa: F401

    with contextlib.suppress(OSError):  # the launcher gone already: _serve sees it and returns
        _send_msg(sock, {"ready": True})
    _serve(sock)
    # The launcher has hung up. Leave without the interpreter's teardown: with torch and dynamo
    # imported it takes ~1 s of CPU, which the launcher would wait for at every job's end, and the
    # template holds nothing that needs it (no files, no threads, no state).
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
