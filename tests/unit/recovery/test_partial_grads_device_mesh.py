"""Partial DTensor gradients are settled before the update guard on ``job.device_mesh()`` too,
not only on a mesh the script made itself: ``job.track()`` installs the settling for every
optimizer over DTensors (recovery/script_mesh.settle_before_update). Run plainly, in a process of
its own (``checkpointless.init()`` makes a world of one once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT, SCRIPTS

pytestmark = pytest.mark.timeout(120)


def test_a_job_device_mesh_models_partial_gradient_is_replicated_before_every_step_hook() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINTLESS_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "partial_grads_mesh.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_backward"] == ["(Partial(sum),)"] * 2, got  # what backward leaves
    assert got["seen_by_pre_hooks"] == ["(Replicate(),)"] * 2, got  # settled before them all
