"""``comm.script_groups.made_by_torch``: a group made inside it on the job's default group is
torch's own c10d group (DCP's one-rank CPU group, state/checkpoint_writer.py); outside it,
``dist.new_group`` makes one of the job's resilient groups.

Run under ``checkpointless.init()`` run plainly (a world of one), in a child process: the default
group it makes is the process's own for good.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

_SCRIPT = """
import torch.distributed as dist, checkpointless as cl
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.comm.script_groups import made_by_torch

with made_by_torch():  # no default group yet: nothing to hide, nothing happens
    assert not dist.is_initialized()
job = cl.init()
world = dist.group.WORLD
assert isinstance(world, ResilientProcessGroup), world

with made_by_torch():
    own = dist.new_group(ranks=[dist.get_rank()], backend="gloo", use_local_synchronization=True)
assert isinstance(own, dist.ProcessGroup) and not isinstance(own, ResilientProcessGroup), type(own)
assert dist.get_backend(own) == "gloo"

try:  # the hook comes back however the block ends
    with made_by_torch():
        raise KeyError("inside")
except KeyError:
    pass
theirs = dist.new_group(backend="gloo")
assert isinstance(theirs, ResilientProcessGroup), type(theirs)
print("ok", type(own).__name__, type(theirs).__name__)
"""


def test_new_group_is_torch_own_inside_and_the_jobs_outside() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    p = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=50, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["ok", "ProcessGroup", "ResilientProcessGroup"], p.stdout
    assert "terminate called" not in p.stderr, p.stderr[-2000:]
