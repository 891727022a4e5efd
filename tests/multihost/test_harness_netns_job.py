"""The shared namespace-job helper (tests/helpers/harness/netns_job.py): its run-directory reader and its
input checks. The jobs it starts are tested by the four multi-host modules that use it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.harness.netns_job import read_records, start_netns_job
from tests.helpers.wait import wait_for

pytestmark = pytest.mark.timeout(60)


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    f = tmp_path / "rank-0.jsonl"
    assert read_records(f) == []  # not written yet
    f.write_text('{"event": "commit", "step": 0}\n\n{"event": "commit", "st')
    assert read_records(f) == [{"event": "commit", "step": 0}]
    with f.open("a") as out:
        out.write('ep": 1}\n')
    assert [e["step"] for e in read_records(f)] == [0, 1]


def test_wait_for_names_what_it_waited_for() -> None:
    wait_for(lambda: [1], time.monotonic(), "something already true")
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="timed out waiting for rank 2 to commit"):
        wait_for(lambda: [], t0 + 0.2, "rank 2 to commit")
    assert time.monotonic() - t0 < 5


@pytest.mark.netns
def test_a_layout_that_does_not_fit_the_cluster_is_refused_before_anything_starts(
    netns_hosts: Any, tmp_path: Path
) -> None:
    cluster = netns_hosts(2)
    run_dir = tmp_path / "job" / "run"
    with pytest.raises(ValueError, match=r"nnodes=2 \+ spare_nodes=1 != 2 hosts"):
        start_netns_job(cluster, run_dir, tmp_path / "corpus", [])
    with pytest.raises(ValueError, match="1 shm_dirs for 2 hosts"):
        start_netns_job(cluster, run_dir, tmp_path / "corpus", [], spare_nodes=0, shm_dirs=[tmp_path])
    assert not run_dir.parent.exists(), "a refused job must leave nothing behind"
    assert all(h.pids() == [] for h in cluster.hosts)
