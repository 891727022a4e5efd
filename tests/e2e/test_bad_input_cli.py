"""Bad values for every flag of `run`, `data prepare` and `simulate`: one clear line naming the
value and the fix, exit code 2, and nothing left behind (no run dir, no temporary file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT
from tests.helpers.paths import SCRIPTS

SCRIPT = SCRIPTS / "slow_steps.py"


def cli(cwd: Path, *args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "checkpointless", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def place(tmp_path: Path) -> Path:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    return tmp_path


RUN_CASES = [
    (["--control-port", "70000"], "--control-port 70000 is not a port; give 0..65535"),
    (["--control-port", "-1"], "--control-port -1 is not a port"),
    (["--port-base", "65000", "--port-range", "1000"], "ends at port 65999, past 65535"),
    (["--port-base", "80"], "--port-base 80 is out of range; give 1024..65535"),
    (["--port-range", "0"], "--port-range 0 must be at least 1"),
    (["--hang-timeout", "nan"], "--hang-timeout must be a finite number (got nan)"),
    (["--spare-wait", "inf"], "--spare-wait must be a finite number (got inf)"),
    (["--recovery-timeout=-1"], "--recovery-timeout must be a positive number of seconds (got -1.0)"),
    (["--hang-factor", "nan"], "--hang-factor must be a finite number (got nan)"),
    (["--spares", "100000"], "--spares 100000 is more than 1024 processes"),
    (["--max-restarts", "-1"], "--max-restarts must be 0 or more (got -1)"),
    (["--nproc", "x"], "argument --nproc: invalid int value: 'x'"),
    (["--host", ""], "--host is empty"),
    (["--host", "999.1.1.1"], "--host '999.1.1.1' is not a known address"),
    (["--inject", "random:seed=x"], "fault 'random:seed=x': seed='x' is not an integer"),
    (["--inject", "random:count=-1"], "fault 'random:count=-1': count=-1 must be 0 or more"),
    (["--inject", "random:steps=40-5"], "steps=40-5 is reversed; write the smaller end first (5-40)"),
    (["--inject", ""], "empty fault spec"),
    (["--run-dir", "{tmp}/afile/run"], "is under '{tmp}/afile', which is a file"),
    (["--run-dir", "{tmp}/afile"], "'{tmp}/afile' exists and is not a directory"),
    (["--run-dir", ""], "--run-dir is empty"),
    (["--checkpoint-every", "5d"], "--checkpoint-every '5d' is not a step count or a time"),
    (["--checkpoint-every", "-2"], "give 0 (off), a number of steps such as 500, or a time such as 90s"),
    (["--checkpoint-dir", "{tmp}/afile/ck"], "'{tmp}/afile' is not a directory"),
    (["--checkpoint-dir", ""], "--checkpoint-dir is empty"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "needle"), RUN_CASES, ids=[" ".join(a) for a, _ in RUN_CASES])
def test_run_refuses_bad_flags(place: Path, args: list[str], needle: str) -> None:
    before = listing(place)
    args = [a.replace("{tmp}", str(place)) for a in args]
    has_run_dir = "--run-dir" in args
    rc, out = cli(
        place, "run", *([] if has_run_dir else ["--run-dir", str(place / "run")]), *args, str(SCRIPT)
    )
    assert rc == 2, out
    assert needle.replace("{tmp}", str(place)) in out, out
    # one error line (after argparse's usage text, for a value that does not parse), not a traceback
    assert "Traceback" not in out and "error:" in out.strip().splitlines()[-1], out
    assert listing(place) == before  # no run dir, no runs/, no secret


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("script", "needle"),
    [("adir", "is a directory; pass the path of a Python file"), ("", "the training script path is empty")],
)
def test_run_refuses_a_script_that_is_not_a_file(place: Path, script: str, needle: str) -> None:
    before = listing(place)
    rc, out = cli(place, "run", str(place / script) if script else "")
    assert rc == 2 and needle in out and "Traceback" not in out, out
    assert listing(place) == before


PREPARE_CASES = [
    (["c.jsonl", "-o", "adir"], "--output 'adir' is a directory; name a file in it"),
    (["c.jsonl", "-o", "missing/x.tokens"], "directory 'missing' does not exist; create it first"),
    (["c.jsonl", "-o", "afile/x.tokens"], "'afile' is a file, not a directory"),
    (["c.jsonl", "-o", ""], "--output is empty"),
    (["adir", "-o", "x.tokens"], "input 'adir' is a directory"),
    (["nope.jsonl", "-o", "x.tokens"], "nope.jsonl: input file not found"),
    (["c.jsonl", "-o", "x.tokens", "--chunk-bytes", "12"], "--chunk-bytes 12 must be a multiple of 8"),
    (["c.jsonl", "-o", "x.tokens", "--text-key", ""], "--text-key is empty"),
    (["c.jsonl", "-o", "x.tokens", "--tokenizer", "hf:"], "--tokenizer 'hf:' is not understood"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "needle"), PREPARE_CASES, ids=[" ".join(a) for a, _ in PREPARE_CASES])
def test_prepare_refuses_bad_arguments(place: Path, args: list[str], needle: str) -> None:
    before = listing(place)
    rc, out = cli(place, "data", "prepare", *args, "--quiet")
    assert rc == 2 and needle in out and "Traceback" not in out, out
    assert listing(place) == before  # no output, no hidden temporary file


SIMULATE_CASES = [
    (["--days", "nan"], "--days nan must be a number of days > 0"),
    (["--days", "1e9"], "--days 1000000000.0 must be a number of days > 0 and <= 3650"),
    (["--seeds", "0"], "--seeds 0 must be from 1 to"),
    (["--gpus", "99999999999999"], "99999999999999 GPUs is more than"),
    (["--calibration", "adir"], "--calibration 'adir' is not a file"),
    (["--out", "afile"], "--out 'afile' exists and is not a directory"),
    (["--out", "afile/x"], "--out 'afile/x' is under 'afile', which is a file"),
    (["--out", ""], "argument --out: the path is empty"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "needle"), SIMULATE_CASES, ids=[" ".join(a) for a, _ in SIMULATE_CASES])
def test_simulate_refuses_bad_arguments(place: Path, args: list[str], needle: str) -> None:
    before = listing(place)
    rc, out = cli(place, "simulate", "--no-plot", *args)
    assert rc == 2 and needle in out and "Traceback" not in out, out
    assert listing(place) == before


@pytest.mark.timeout(60)
def test_a_refused_command_answers_without_importing_torch(place: Path) -> None:
    # A bad flag is answered before anything heavy loads: importing torch is 1.5-2 s of CPU on a
    # small machine, and `data prepare` and the launcher never need it themselves.
    probe = (
        "import sys\n"
        "from checkpointless.cli import main\n"
        "for argv in (['data', 'prepare', 'c.jsonl', '-o', 'missing/x.tokens'], ['run', '--nproc', '0', 'x.py'],"
        " ['simulate', '--no-plot', '--days', 'nan']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=place, env=env, capture_output=True, text=True, timeout=50
    )
    assert proc.stdout.strip().splitlines()[-1] == "no torch", proc.stdout + proc.stderr
