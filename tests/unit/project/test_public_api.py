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
