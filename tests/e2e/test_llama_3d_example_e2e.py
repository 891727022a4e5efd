"""examples/llama_3d.py: a small Llama (RMSNorm, RoPE, SwiGLU) on replicate 2 x FSDP 2 x TP 2.

Eight ranks under the launcher (gloo, CPU): the fault-free run holds four states, one per
(shard, tp) coordinate, each the same on both dp replicas; a SIGKILL and an exception in
backward on other ranks end with every rank's shards bitwise equal to the fault-free run's.
A ``soak`` test (8 ranks on two cores: about 30 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import EXAMPLE, run_job
from tests.helpers.reference import ReferenceRuns

LLAMA_3D = EXAMPLE.parent / "llama_3d.py"
ARGS = ["--steps", "10"]


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_the_3d_example_is_recovered_bitwise(tmp_path: Path, corpus: Path, reference: ReferenceRuns) -> None:
    ref = reference(8, script=LLAMA_3D, script_args=ARGS, replicated=False, timeout=250)
    d = ref.digests
    # rank r is (dp = r // 4, shard = r // 2 % 2, tp = r % 2): four states, each on both replicas
    assert sorted(d) == list(range(8)) and all(d[r] == d[r + 4] for r in range(4)), d
    assert len({d[r] for r in range(4)}) == 4, d
    faults = ["kill:rank=5:step=4", "raise:rank=2:step=7:site=backward"]
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=8,
        spares=1,
        faults=faults,
        script=LLAMA_3D,
        script_args=ARGS,
        timeout=250,
    )
    assert res.rc == 0, res.output[-6000:]
    assert res.digests == ref.digests, "final shards differ from the fault-free run's"
    assert len(res.of("recovery")) == 2, res.output[-4000:]
    # the lost rank (dp 1, shard 0, tp 1) takes its state from (dp 0, shard 0, tp 1)
    plans = [e for e in res.of("plan") if e["generation"] > 0]
    assert plans and [5, 1] in plans[0].get("sources", []), plans
    assert not res.left_behind(), "processes of the job were left behind"
