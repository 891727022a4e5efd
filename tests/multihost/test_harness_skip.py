"""The harness's skip-or-fail rule, as pure functions: a developer without root skips with a reason,
CI (CHECKPOINTLESS_REQUIRE_HARNESS=1) fails instead of skipping."""

from __future__ import annotations

import pytest

from tests.helpers.harness._common import REQUIRE_ENV, missing_tools
from tests.helpers.harness.fixtures import unavailable
from tests.helpers.harness.hosts import netns_unavailable_reason
from tests.helpers.harness.slurm import slurm_unavailable_reason

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


def test_slurm_conf_gives_each_node_its_own_port_and_paths() -> None:
    from pathlib import Path

    from tests.helpers.harness.slurm_conf import render_conf

    text = render_conf(
        base=Path("/tmp/cpls-1-abcdef"),
        cluster_name="cplabcdef",
        munge_socket=Path("/tmp/cpls-1-abcdef/munge/sock/munge.socket"),
        ctld_port=7000,
        node_ports={"n1": 7001, "n2": 7002},
        cpus_per_node=1,
    )
    nodes = [line for line in text.splitlines() if line.startswith("NodeName=")]
    assert [n.split()[0] for n in nodes] == ["NodeName=n1", "NodeName=n2"]
    assert "Port=7001" in nodes[0] and "Port=7002" in nodes[1]
    assert "SlurmdSpoolDir=/tmp/cpls-1-abcdef/spool/%n" in text and "slurmd-%n.log" in text
    assert "NoInAddrAny" in text and "AuthInfo=socket=/tmp/cpls-1-abcdef/munge/sock/munge.socket" in text
    with pytest.raises(ValueError, match="distinct"):
        render_conf(
            base=Path("/x"),
            cluster_name="c",
            munge_socket=Path("/x/s"),
            ctld_port=7000,
            node_ports={"n1": 7000},
            cpus_per_node=1,
        )
