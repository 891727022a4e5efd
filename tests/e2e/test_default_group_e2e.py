"""torch's default process group under ``checkpointless run``: a script that calls
``DistributedSampler(ds)``, ``dist.all_reduce`` and ``dist.barrier()`` with no group survives a
kill and an exception, and every rank ends bitwise equal (weights and every step's reduced loss)
to the fault-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, run_job

NOWHERE = Path("/nonexistent")
SCRIPT = ROOT / "tests" / "scripts" / "default_group.py"


@pytest.mark.timeout(300)
def test_default_group_collectives_survive_kill_and_exception_bitwise(tmp_path: Path) -> None:
    ref = run_job(tmp_path / "ref", NOWHERE, 2, 0, script=SCRIPT, script_args=["--steps", "40"])
    assert ref.rc == 0 and ref.digest is not None, ref.output[-4000:]
    # rank 1 dies at step 12 (its peer is then blocked in a collective: the default group's
    # all_reduce or the gradients'), rank 0 raises at step 25; a spare takes rank 1's place
    faults = ["kill:rank=1:step=12", "raise:rank=0:step=25"]
    res = run_job(
        tmp_path / "run", NOWHERE, 2, 1, faults, script=SCRIPT, script_args=["--steps", "40"], timeout=240
    )
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert len(res.of("fault_injected")) == 2 and len(res.of("recovery")) >= 2, res.output[-4000:]
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(60)
def test_default_group_standalone_world_of_one(tmp_path: Path) -> None:
    # run plainly (no launcher): init() still gives torch a default group, a world of one
    import subprocess
    import sys

    out = tmp_path / "d{rank}"
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "3", "--digest-out", str(out)],
        capture_output=True,
        text=True,
        timeout=50,
        env={k: v for k, v in __import__("os").environ.items() if not k.startswith("CHECKPOINTLESS_")},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert len((tmp_path / "d0").read_text().strip()) == 64


@pytest.mark.timeout(60)
def test_init_after_a_default_group_of_the_script_is_a_clear_error(tmp_path: Path) -> None:
    # two default groups cannot coexist; the error must name the call to remove
    import os
    import subprocess
    import sys

    code = (
        "import torch.distributed as dist, checkpointless as cl\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "cl.init()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    assert p.returncode != 0
    assert "ConfigError" in p.stderr and "dist.init_process_group ran before" in p.stderr, p.stderr[-2000:]
