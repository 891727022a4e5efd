"""Silent divergence and the first-step allowance: the pure rules, situations in, verdicts out."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from checkpointless.coordinator.rules.budget import first_step_limit
from checkpointless.coordinator.rules.decisions import MemberReport, plan_recovery
from checkpointless.coordinator.rules.hangs import WorkerHealth, find_hung
from checkpointless.recovery.divergence import due, judge, state_digest

pytestmark = pytest.mark.timeout(30)


def test_all_equal_digests_are_no_divergence() -> None:
    v = judge([5, 5, 5, 5])
    assert v.divergent == () and v.has_majority


def test_the_minority_is_named() -> None:
    v = judge([7, 7, 9, 7])
    assert v.divergent == (2,) and v.has_majority
    assert "[2]" in v.describe(50) and "step 49" in v.describe(50)


def test_a_tie_trusts_nobody() -> None:
    v = judge([1, 2])
    assert v.divergent == (0, 1) and not v.has_majority
    assert judge([1, 2, 3]).divergent == (0, 1, 2)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=9))
def test_judge_heals_only_ranks_outside_a_strict_majority(digests: list[int]) -> None:
    v = judge(digests)
    counts = {d: digests.count(d) for d in digests}
    top = max(counts.values())
    if top == len(digests):
        assert v.divergent == ()
    elif 2 * top > len(digests):
        right = next(d for d, c in counts.items() if c == top)
        assert v.divergent == tuple(r for r, d in enumerate(digests) if d != right)
    else:
        assert v.divergent == tuple(range(len(digests)))


def test_divergent_ranks_receive_the_majoritys_state() -> None:
    # what the ranks report after the check at 50 committed steps named rank 1
    plan = plan_recovery([MemberReport(0, 50, True), MemberReport(1, 50, False), MemberReport(2, 50, True)])
    assert (plan.target_step, plan.source, plan.receivers) == (50, 0, (1,))


def test_due_every_n_commits_and_off_at_zero() -> None:
    assert [s for s in range(0, 301) if due(s, 100)] == [100, 200, 300]
    assert not any(due(s, 0) for s in range(100))


def _replica() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    return m, opt


def test_digest_sees_one_bit_in_a_parameter_and_in_optimizer_state() -> None:
    a, b = _replica(), _replica()
    assert state_digest([a[0]], [a[1]]) == state_digest([b[0]], [b[1]])
    base = state_digest([b[0]], [b[1]])
    with torch.no_grad():
        w = b[0][0].weight
        w.view(-1).view(torch.int32)[3] ^= 1  # the lowest bit of one float
    assert state_digest([b[0]], [b[1]]) != base
    c = _replica()
    state = c[1].state[c[0][0].bias]
    state["exp_avg_sq"].view(torch.int32)[0] ^= 1
    assert state_digest([c[0]], [c[1]]) != base
    assert 0 <= base < 2**63  # travels as one int64


def test_first_step_gets_its_own_allowance_and_message() -> None:
    now = 1000.0
    # rank 1 is a fresh process in its first step (compiling), silent on progress for 100 s
    health = [WorkerHealth(0, now, now - 100, True), WorkerHealth(1, now, now - 100, False, first_step=True)]
    limit = first_step_limit(10.0, 300.0)
    assert limit == 300.0 and first_step_limit(400.0, 300.0) == 400.0
    assert find_hung(health, now, 10.0, 10.0, limit) == ([], "")
    later = now + 250  # heartbeats kept coming; progress did not
    health = [
        WorkerHealth(0, later, now - 100, True),
        WorkerHealth(1, later, now - 100, False, first_step=True),
    ]
    culprits, why = find_hung(health, later, 10.0, 10.0, limit)
    assert (
        culprits == [1] and "first step" in why and "--first-step-timeout" in why and "torch.compile" in why
    )


def test_a_seasoned_rank_is_still_judged_by_the_ordinary_limit() -> None:
    now = 1000.0
    health = [WorkerHealth(0, now, now - 20, False), WorkerHealth(1, now, now - 20, False, first_step=True)]
    culprits, why = find_hung(health, now, 10.0, 10.0, 300.0)
    assert culprits == [0] and "first step" not in why


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("divergence_check", -1, "--divergence-check"), ("first_step_timeout", 0.0, "--first-step-timeout")],
)
def test_bad_new_flags_are_refused_naming_the_flag(field: str, value: float, flag: str) -> None:
    from checkpointless.errors import ConfigError
    from checkpointless.launcher.model import LaunchConfig

    cfg = LaunchConfig(script=__file__, **{field: value})
    with pytest.raises(ConfigError, match=flag):
        cfg.validate()
