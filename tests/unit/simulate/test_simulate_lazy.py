"""The lazy-connection rebuild model (simulate/plans.py): which peers' keys a rank reads.

gloo's own choice of peers is held to this model in tests/unit/comm/test_gloo_connect.py (real
groups of up to 9 ranks); here the model's own properties, for every rank of groups up to 4,096
ranks and sampled ones up to 100,000.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.simulate.calibration import Calibration, CommModel
from checkpointless.simulate.plans import comm_start_s, lazy_keys_read, lazy_peers
from checkpointless.simulate.report import SimConfig, full_mesh


@pytest.mark.timeout(60)
def test_every_rank_of_every_small_group_reads_a_symmetric_set_of_log_size() -> None:
    for n in range(1, 130):
        sets = [lazy_peers(r, n) for r in range(n)]
        for r, peers in enumerate(sets):
            assert r not in peers and all(0 <= p < n for p in peers)
            # ring neighbours always: the all-reduce and a state transfer's sends need them
            assert {(r - 1) % n, (r + 1) % n} - {r} <= peers
            # symmetric: whoever reads r's key is a key r reads, so a key's owner answers as
            # many readers as its rank reads keys
            assert all(r in sets[p] for p in peers)
            assert len(peers) == lazy_keys_read(n) <= max(0, 2 * math.ceil(math.log2(n)))
        if n > 1:
            # the barrier's rounds connect the group: from rank 0 every rank is reached
            seen, todo = {0}, [0]
            while todo:
                for p in sets[todo.pop()] - seen:
                    seen.add(p)
                    todo.append(p)
            assert seen == set(range(n))


@pytest.mark.timeout(30)
@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=2, max_value=100_000), data=st.data())
def test_a_rank_of_a_large_group_reads_about_two_log2_n_keys(n: int, data: st.DataObject) -> None:
    r = data.draw(st.integers(min_value=0, max_value=n - 1))
    peers = lazy_peers(r, n)
    assert len(peers) == lazy_keys_read(n)
    assert 1 <= len(peers) <= 2 * math.ceil(math.log2(n))
    assert lazy_peers(r, n, ("allreduce",)) == {(r - 1) % n, (r + 1) % n} - {r}


@pytest.mark.timeout(5)
def test_a_bad_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 4 is not in a group of 4"):
        lazy_peers(4, 4)


@pytest.mark.timeout(5)
def test_the_lazy_rebuild_costs_milliseconds_where_the_full_mesh_costs_seconds() -> None:
    cal = Calibration()
    lazy = comm_start_s(CommModel.ROOTLESS_LAZY, 0.0, 100_000, cal)
    full = comm_start_s(CommModel.ROOTLESS_MEASURED, 0.0, 100_000, cal)
    assert lazy == pytest.approx(
        2 * lazy_keys_read(100_000) * cal.rootless_per_rank_s + 3 * cal.rootless_rtt_s * 17
    )
    assert lazy < 0.02 and full > 18.0
    # it grows with log N, not N
    assert (
        comm_start_s(CommModel.ROOTLESS_LAZY, 0.0, 2_048, cal)
        < lazy
        < 2 * comm_start_s(CommModel.ROOTLESS_LAZY, 0.0, 2_048, cal)
    )


@pytest.mark.timeout(5)
def test_the_full_mesh_what_if_is_the_measured_model_for_both() -> None:
    base = SimConfig()
    # lazy connection is the launcher's default (comm/handle.py:gloo_connect); full is the what-if
    assert (base.cal.rebuild_model, base.cal.restart_model) == (
        CommModel.ROOTLESS_LAZY,
        CommModel.ROOTLESS_LAZY,
    )
    cal = full_mesh(base).cal
    assert (cal.rebuild_model, cal.restart_model) == (
        CommModel.ROOTLESS_MEASURED,
        CommModel.ROOTLESS_MEASURED,
    )
    assert (
        replace(cal, rebuild_model=CommModel.ROOTLESS_LAZY, restart_model=CommModel.ROOTLESS_LAZY) == base.cal
    )
