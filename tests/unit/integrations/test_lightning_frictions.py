"""Lightning frictions (issue 38): ``strategy="checkpointless"`` as a string, and a warning when
the single process of ``python train.py`` is given more than one device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from checkpointless.integrations._lightning_devices import devices_warning
from tests.helpers.jobs import ROOT


@pytest.mark.timeout(30)
def test_devices_warning_only_for_a_plain_process_given_several_devices() -> None:
    why = devices_warning(2, 1, launched=False)
    assert why is not None and "Trainer(devices=2)" in why and "checkpointless run --nproc 2" in why
    assert devices_warning(1, 1, launched=False) is None
    # under a launcher the ranks are its business (devices="auto" may be every GPU of the host)
    assert devices_warning(8, 2, launched=True) is None
    assert devices_warning(2, 2, launched=True) is None


@pytest.mark.timeout(120)
def test_the_strategy_string_resolves_and_extra_devices_are_warned_about_once(tmp_path: Path) -> None:
    """Run in a process of its own: the strategy joins the job (init() is global)."""
    pytest.importorskip("lightning")
    script = tmp_path / "by_name.py"
    script.write_text(
        "import warnings\n"
        "import lightning.pytorch as pl\n"
        "import checkpointless.integrations.lightning as cl_lightning\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    trainer = pl.Trainer(strategy='checkpointless', accelerator='cpu', devices=2, logger=False,\n"
        "                         enable_checkpointing=False, max_steps=1)\n"
        "    trainer.strategy.set_world_ranks()  # Lightning calls it again in setup: still one warning\n"
        "print('STRATEGY', isinstance(trainer.strategy, cl_lightning.CheckpointlessStrategy))\n"
        "print('WORLD', trainer.world_size)\n"
        "for w in caught:\n"
        "    if 'devices=' in str(w.message):\n"
        "        print('WARNED', w.message)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STRATEGY True" in out.stdout and "WORLD 1" in out.stdout, out.stdout + out.stderr[-2000:]
    warned = [line for line in out.stdout.splitlines() if line.startswith("WARNED")]
    assert len(warned) == 1 and "Trainer(devices=2)" in warned[0], out.stdout
    assert "checkpointless run --nproc 2" in warned[0]
