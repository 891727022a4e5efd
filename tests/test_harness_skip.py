"""The harness's skip-or-fail rule, as pure functions: a developer without root skips with a reason,
CI (CHECKPOINTLESS_REQUIRE_HARNESS=1) fails instead of skipping."""

from __future__ import annotations

import pytest

from harness._common import REQUIRE_ENV, missing_tools
from harness.fixtures import unavailable
from harness.hosts import netns_unavailable_reason
from harness.slurm import slurm_unavailable_reason

pytestmark = pytest.mark.timeout(30)


def test_without_root_the_reason_says_so() -> None:
    for reason in (netns_unavailable_reason(euid=1000), slurm_unavailable_reason(euid=1000)):
        assert reason is not None and "needs root" in reason and "make test" in reason


def test_missing_tools_are_named() -> None:
    assert missing_tools(["sh", "no-such-tool-cplh"]) == ["no-such-tool-cplh"]


def test_skip_for_developers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        unavailable("needs root")


@pytest.mark.parametrize("value", ["1", "yes"])
def test_failure_in_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(REQUIRE_ENV, value)
    with pytest.raises(pytest.fail.Exception, match=f"needs root.*{REQUIRE_ENV}=1"):
        unavailable("needs root")
