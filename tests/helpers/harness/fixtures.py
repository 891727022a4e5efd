"""pytest fixtures for the harnesses (registered by tests/conftest.py).

``netns_hosts(n)`` makes n namespace hosts; ``slurm_cluster`` is a running Slurm cluster. Both
skip with the missing prerequisite named, or fail instead when CHECKPOINTLESS_REQUIRE_HARNESS=1
(set by .ci/run), and remove everything they made when the test ends, passed or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from ._common import REQUIRE_ENV, HarnessUnavailable, exit_on_sigterm, required
from .hosts import NetnsCluster, netns_unavailable_reason
from .slurm import SlurmCluster, slurm_unavailable_reason

__all__ = ["netns_hosts", "slurm_cluster", "unavailable"]


def unavailable(reason: str) -> None:
    """Skip the test for ``reason``, or fail it when the harness is required (CI)."""
    if required():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 makes this a failure, not a skip)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def netns_hosts() -> Iterator[Callable[..., NetnsCluster]]:
    """A factory: ``netns_hosts(3)`` -> a NetnsCluster of 3 hosts, removed after the test."""
    reason = netns_unavailable_reason()
    if reason:
        unavailable(reason)
    exit_on_sigterm()
    made: list[NetnsCluster] = []

    def make(n: int, **kwargs: str) -> NetnsCluster:
        try:
            c = NetnsCluster(n, **kwargs)
        except HarnessUnavailable as e:
            unavailable(str(e))
            raise
        made.append(c)
        return c

    try:
        yield make
    finally:
        errors = []
        for c in made:
            try:
                c.close()
            except Exception as e:
                errors.append(str(e))
        if errors:
            pytest.fail("; ".join(errors), pytrace=False)


@pytest.fixture
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """A running Slurm cluster (munged, slurmctld, 3 slurmd) private to this test; stopped after.
    A test that needs another number of nodes parametrizes it indirectly:
    ``@pytest.mark.parametrize("slurm_cluster", [4], indirect=True)``."""
    reason = slurm_unavailable_reason()
    if reason:
        unavailable(reason)
    exit_on_sigterm()
    cluster = SlurmCluster(nodes=getattr(request, "param", 3))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
