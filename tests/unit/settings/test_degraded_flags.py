"""--when-no-spare and --min-replicas (issue 39, degraded mode): parsed, checked against --nproc,
and carried to the agents; every policy accepted."""

from __future__ import annotations

import pytest

from checkpointless.cli import build_parser
from checkpointless.errors import ConfigError
from checkpointless.protocol import AgentWelcome, decode, encode
from checkpointless.settings import JobSettings, values_from
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(60)

SCRIPT = str(ROOT / "tests" / "scripts" / "slow_steps.py")


def _settings(*flags: str) -> JobSettings:
    args = build_parser().parse_args(["run", *flags, SCRIPT])
    return JobSettings.from_flags(values_from(JobSettings, args), local_agent=True)


def test_the_default_waits_for_a_spare_then_goes_on_degraded() -> None:
    cfg = _settings()
    assert (cfg.when_no_spare, cfg.min_replicas) == ("wait", 1)
    cfg.validate()


def test_min_replicas_at_most_nproc() -> None:
    _settings("--nproc", "4", "--min-replicas", "4").validate()
    with pytest.raises(ConfigError, match="--min-replicas 5 is more than the job's 4 ranks"):
        _settings("--nproc", "4", "--min-replicas", "5").validate()
    with pytest.raises(ConfigError, match="--min-replicas"):
        _settings("--min-replicas", "0").validate()


@pytest.mark.parametrize("policy", ["shrink", "wait", "fail"])
def test_every_policy_is_accepted(policy: str) -> None:
    cfg = _settings("--when-no-spare", policy, "--nproc", "4", "--min-replicas", "2")
    cfg.validate()
    assert cfg.when_no_spare == policy


def test_the_welcome_carries_them() -> None:
    cfg = _settings("--nproc", "4", "--min-replicas", "3")
    welcome = AgentWelcome(agent_id=1, job_id="j", control="127.0.0.1:1", run_dir="/r", shm_key="k", job=cfg)
    back = decode(encode(welcome))
    assert isinstance(back, AgentWelcome)
    assert (back.job.min_replicas, back.job.when_no_spare) == (3, "wait")
