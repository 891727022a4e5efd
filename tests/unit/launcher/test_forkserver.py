"""The fork server: workers forked from a template that imported torch once behave like fresh
interpreters (exit status, signals, environment, descriptors, fresh random seeds)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from checkpointless.launcher.forkserver import ForkServer, become_subreaper, reap_strays

pytestmark = pytest.mark.timeout(90)

SCRIPT = """
import os, random, sys, socket
sys.stderr.write(f"role={os.environ['ROLE']} args={sys.argv[1:]} rand={random.random()}\\n")
sys.stderr.write(f"session_leader={os.getsid(0) == os.getpid()} template_session={os.getsid(0) == int(os.environ['TEMPLATE_SID'])}\\n")
if "STORE" in os.environ:
    s = socket.socket(fileno=int(os.environ["STORE"]))
    sys.stderr.write(f"listening={s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)}\\n")
import torch
sys.stderr.write(f"threads={torch.get_num_threads()} x={float(torch.ones(3).sum())}\\n")
if os.environ["ROLE"] == "sleeper":
    import time; time.sleep(60)
raise SystemExit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ForkServer:
    assert become_subreaper()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    fs = ForkServer(sys.executable, env, None)
    assert fs.wait_ready(60), "the template did not start"
    yield fs
    fs.close()


def run(
    server: ForkServer, tmp_path: Path, name: str, env: dict[str, str], listener: socket.socket | None = None
):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    r, w = os.pipe()
    fds = {"stderr": w}
    if listener is not None:
        fds["STORE"] = listener.fileno()
    env = dict(os.environ, TEMPLATE_SID=str(os.getsid(server.popen.pid)), **env)
    p = server.spawn([sys.executable, str(script), name], env, str(tmp_path), fds)
    os.close(w)
    return p, r


def read_all(fd: int) -> str:
    with os.fdopen(fd, "rb") as f:
        return f.read().decode()


def test_exit_status_environment_and_descriptors(server: ForkServer, tmp_path: Path) -> None:
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        p, r = run(server, tmp_path, "a1", {"ROLE": "worker", "CODE": "3"}, lst)
        assert p.wait(30) == 3
    out = read_all(r)
    assert "role=worker args=['a1']" in out and "listening=1" in out and "threads=1 x=3.0" in out, out
    # a session of its own, as torchrun gives each worker (the kernel's autogroup scheduling:
    # ranks sharing one session slowed two ranks on two cores by 3-5%, forkserver.py)
    assert "session_leader=True template_session=False" in out, out


def test_each_fork_draws_fresh_python_randomness(server: ForkServer, tmp_path: Path) -> None:
    values = []
    for i in range(2):
        p, r = run(server, tmp_path, f"r{i}", {"ROLE": "worker"})
        assert p.wait(30) == 0
        values.append(read_all(r).split("rand=")[1].split()[0])
    assert values[0] != values[1]


def test_a_killed_fork_reports_the_signal_and_strays_are_reaped(server: ForkServer, tmp_path: Path) -> None:
    p, r = run(server, tmp_path, "s", {"ROLE": "sleeper"})
    assert os.getppid() != p.pid
    # the worker is our child (re-parented to this subreaper), not the template's
    with open(f"/proc/{p.pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    time.sleep(0.5)
    p.send_signal(signal.SIGKILL)
    assert p.wait(10) == -signal.SIGKILL
    os.close(r)
    reap_strays({server.popen.pid})  # nothing of ours left as a zombie


PREFORK = """
import os, sys, threading
import torch._dynamo
from checkpointless.launcher.forkserver import ForkServerError, become_subreaper, prefork, take_preforked
assert become_subreaper()
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
try:
    prefork()
    print("refused=False")
except ForkServerError as e:
    print(f"refused=True {e}")
stop.set()
t.join()
prefork()
fs = take_preforked()
assert take_preforked() is None  # handed out once
assert fs.wait_ready(30)
with open(f"/proc/{fs.popen.pid}/stat") as f:
    print(f"template_parent_is_us={int(f.read().rsplit(')', 1)[1].split()[1]) == os.getpid()}")
script = sys.argv[1]
r, w = os.pipe()
out = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT)
env = dict(os.environ, ROLE="worker", CODE="4", TEMPLATE_SID=str(os.getsid(fs.popen.pid)))
p = fs.spawn([sys.executable, script, "x"], env, os.getcwd(), {"stdout": out, "stderr": w})
os.close(w); os.close(out)
print(f"code={p.wait(30)}")
print(os.fdopen(r).read())
fs.close()
print(f"template_gone={fs.popen.poll() is not None}")
"""


def test_a_template_forked_from_a_process_that_imported_torch(tmp_path: Path) -> None:
    """prefork (the test zygote's launchers use it): the template is a fork of the caller, refused
    while another thread runs (a lock it held would stay held in the fork); its workers are
    like the fresh template's, their stdout the descriptor passed with each spawn."""
    import subprocess

    (tmp_path / "child.py").write_text(
        SCRIPT.replace("raise SystemExit", "print('to stdout')\nraise SystemExit")
    )
    (tmp_path / "main.py").write_text(PREFORK)
    res = subprocess.run(
        [sys.executable, str(tmp_path / "main.py"), str(tmp_path / "child.py"), str(tmp_path / "stdout")],
        capture_output=True,
        text=True,
        timeout=80,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "refused=True" in out and "no thread but this one" in out, out
    assert "template_parent_is_us=True" in out and "code=4" in out and "template_gone=True" in out, out
    assert "role=worker args=['x']" in out and "threads=1 x=3.0" in out, out
    assert "session_leader=True template_session=False" in out, out
    assert (tmp_path / "stdout").read_text() == "to stdout\n"
