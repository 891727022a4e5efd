"""The launcher starts the observers (``--metrics-port``, ``--progress``) that the command line
hands it, and imports none itself (issue 35): a launcher given none refuses a job that asks for
them, before it starts anything, and takes back the run directory it made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpointless.config import ENV
from checkpointless.errors import ConfigError
from checkpointless.launcher import launcher as launcher_module
from checkpointless.launcher.launcher import LaunchConfig, Launcher
from checkpointless.launcher.shell import NoObservers

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("flag", [{"metrics_port": 0}, {"progress": 1.0}])
def test_a_launcher_given_no_observers_refuses_a_job_that_asks_for_them(
    tmp_path: Path, flag: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the launcher puts the job's key in this process's environment, and routes the package's
    # logger to stderr without propagation: both are put back for the tests after this one
    monkeypatch.setenv(ENV.SHM_KEY, os.environ.get(ENV.SHM_KEY, ""))
    monkeypatch.setattr(launcher_module, "setup_logging", lambda who: None)
    run_dir = tmp_path / "run"
    cfg = LaunchConfig(script=__file__, nproc=1, run_dir=run_dir, **flag)  # type: ignore[arg-type]
    launcher = Launcher(cfg)
    assert run_dir.is_dir()
    with pytest.raises(ConfigError, match="--metrics-port and --progress need the observers"):
        launcher.run()
    assert not run_dir.exists()  # made by this launcher, and taken back


def test_no_observers_closes_quietly() -> None:
    NoObservers().close()
