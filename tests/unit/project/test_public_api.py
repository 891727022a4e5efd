"""The top-level API holds only what a training script uses; test helpers live in checkpointless.testing."""

from __future__ import annotations

import importlib

import pytest

import checkpointless

pytestmark = pytest.mark.timeout(60)

# what a training script touches: init and what it returns, the gradient wrapper, and the errors it
# may catch. A new name here is a promise to users: add it on purpose.
SCRIPT_API = {
    "init",
    "Job",
    "Step",
    "DataParallel",
    "CheckpointlessError",
    "CommAborted",
    "ConfigError",
    "DataError",
    "NotRecoverableError",
    "RendezvousError",
    "StateTransferError",
    "StepAborted",
}


def test_top_level_all_is_the_script_api_and_every_name_resolves() -> None:
    assert set(checkpointless.__all__) == SCRIPT_API
    for name in checkpointless.__all__:
        assert getattr(checkpointless, name) is not None


def test_test_helpers_are_in_testing_not_the_top_level() -> None:
    testing = importlib.import_module("checkpointless.testing")
    for name in ("FaultSpec", "InjectedFault", "parse_faults"):
        assert name in testing.__all__
        assert name not in checkpointless.__all__
    with pytest.raises(AttributeError, match="parse_faults"):
        _ = checkpointless.parse_faults  # type: ignore[attr-defined]
    assert issubclass(testing.InjectedFault, RuntimeError)


# Job's members a training script uses (docs/configuration.md's table). ``internals`` is for our own
# integrations and tests.
JOB_API = {
    "rank",
    "world_size",
    "committed_step",
    "generation",
    "is_replacement",
    "job_id",
    "device",
    "data_parallel",
    "device_mesh",
    "track",
    "loader",
    "section",
    "inject",
    "steps",
    "epochs",
    "epoch_steps",
    "epoch_abandoned",
    "stop",
    "generator",
    "record",
    "all_reduce",
    "internals",
}


def test_job_surface_is_the_script_api_each_member_documented() -> None:
    job_cls = checkpointless.Job
    public = {n for n in vars(job_cls) if not n.startswith("_")}
    assert public == JOB_API
    undocumented = sorted(n for n in public if not (getattr(job_cls, n).__doc__ or "").strip())
    assert undocumented == []
    removed = ("step", "dp_rank", "dp_size", "comm", "env", "placement", "tracked", "groups")
    assert [n for n in removed if hasattr(job_cls, n)] == []
