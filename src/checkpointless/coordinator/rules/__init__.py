"""The coordinator's rules: pure functions (and small value types) over what it has observed,
a decision out. No I/O, no clock, no coordinator state.

Nothing here imports anything above it: only the standard library and ``checkpointless.errors``
(tests/unit/project/test_architecture.py holds that). The coordinator's components in ``coordinator/`` apply
these rules to their own state; the agent and the launcher use a few of them too (the election).

* ``decisions``: the recovery plan from the members' reports, and the wait for spares;
* ``hangs``: which ranks hold the job up, from their heartbeats and progress;
* ``budget``: the fault budget, respawn loops, the no-progress limits;
* ``fatal``: endings no spare can change (a ConfigError, an unadopted script's clean exit);
* ``fault_step``: the step a fault event names;
* ``sections``: which protected sections every rank takes as done after a recovery;
* ``placement``: which host a rank or a spare goes to, and which spares take which ranks;
* ``stragglers``: hosts whose steps run persistently slower than the others';
* ``prefetch``: which ranks a spare on a spare host may take;
* ``width`` and ``mesh_width``: degraded mode, for data parallelism and for an HSDP mesh;
* ``election`` and ``rebuild``: a successor coordinator after a failover.
"""

__all__: list[str] = []
