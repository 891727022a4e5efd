"""A worker's output as ``launcher/run_script.py`` leaves it: the launcher sets PYTHONUNBUFFERED, and
two ranks printing at once onto the job's one output must still give whole lines (a test that
reads a rank's line from the job's output found two ranks' lines run together)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

LINES = 3000

SCRIPT = f"""
import os, sys
me = os.getpid()
for i in range({LINES}):
    print(f"line {{i}} from {{me}} " + "x" * 40)
print("partial", end="")  # no newline: it must still come out at the exit
"""


def test_ranks_printing_at_once_onto_one_output_give_whole_lines(tmp_path: Path) -> None:
    script = tmp_path / "printer.py"
    script.write_text(SCRIPT)
    r, w = os.pipe()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "checkpointless.launcher.run_script", str(script)]
    procs = [subprocess.Popen(argv, stdout=w, env=env) for _ in range(2)]
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    assert [p.wait(timeout=30) for p in procs] == [0, 0]
    pids = {str(p.pid) for p in procs}
    body = out.replace("partial", "")
    lines = body.splitlines()
    assert out.count("partial") == 2
    assert len(lines) == 2 * LINES, "lines were lost or run together"
    for line in lines:
        word = line.split()
        assert len(word) == 5 and word[0] == "line" and word[3] in pids and word[4] == "x" * 40, line
