"""A recovery's downtime and its phases, from what the coordinator recorded during its round.

A pure function: the round's fault records (each with the monotonic ``detected`` time and the wall
``time``), the members' reports and ``recovered`` timings, and the moment every rank had committed
its first step afterwards, in; the ``recovery`` event's fields and the one-line summary out.
"""

from __future__ import annotations

from typing import Any

from checkpointless.coordinator.state import Round

__all__ = ["recovery_fields", "transfer_parts"]


def recovery_fields(
    r: Round,
    first_step_done: float | None,
    first_batches: dict[int, float],
    fired_at: float | None,
    incomplete: str | None = None,
) -> tuple[dict[str, Any], str, bool]:
    """Return (event fields, human summary, whether ``fired_at`` was used for ``detect_s``).

    ``first_step_done`` is None when the round never saw every rank commit a step afterwards (a
    newer fault, the end of the job): the downtime then ends when the generation formed, and
    ``incomplete`` says why.
    """
    t0 = min(f["detected"] for f in r.faults)
    stopped = max(r.report_times.values()) if r.report_times else r.plan_sent
    rec = r.recovered.values()
    rebuild = max(x.get("rebuild_s", 0.0) for x in rec)
    transfer = max(x.get("transfer_s", 0.0) for x in rec)
    nbytes = max(x.get("bytes", 0.0) for x in rec)
    formed = max(x["time"] for x in rec)
    # the slowest rank's wait for its first batch; the first step is what remains after it
    first_batch = max(first_batches.values(), default=0.0)
    phases: dict[str, Any] = {
        "collect_s": round(stopped - t0, 4),
        "rebuild_s": round(rebuild, 4),
        "transfer_s": round(transfer, 4),
        "first_batch_s": round(first_batch, 4),
        "first_step_s": None
        if first_step_done is None
        else round(max(0.0, first_step_done - formed - first_batch), 4),
    }
    if incomplete is not None:
        phases["incomplete"] = incomplete
    downtime = (formed if first_step_done is None else first_step_done) - t0
    # how long the fault went unnoticed, when we know when it happened (an injected fault)
    first_wall = min(f["time"] for f in r.faults)
    used_fired = fired_at is not None and 0 <= first_wall - fired_at < 600
    if used_fired:
        assert fired_at is not None
        phases["detect_s"] = round(first_wall - fired_at, 4)
    # a failed collective on a survivor is a symptom; name the causes when they are known
    causes = [f for f in r.faults if f["kind"] != "comm"] or r.faults
    kinds = ", ".join(f"{f['kind']} on rank {f['rank']}" for f in causes)
    fields: dict[str, Any] = {
        "generation": r.target,
        "transfer_parts": transfer_parts(r.recovered),
        "faults": [{k: v for k, v in f.items() if k != "detected"} for f in r.faults],
        "downtime_s": round(downtime, 4),
        "state_bytes": nbytes,
        "transport": next((x["transport"] for x in rec if "transport" in x), None),
        **phases,
    }
    first_step = "n/a" if phases["first_step_s"] is None else f"{phases['first_step_s']:.3f}s"
    detected = f"detected after {phases['detect_s']:.3f}s, " if "detect_s" in phases else ""
    summary = (
        f"RECOVERED generation {r.target} from {kinds}: {detected}stop {phases['collect_s']:.3f}s, "
        f"rebuild {rebuild:.3f}s, state {transfer:.3f}s ({nbytes / 1e6:.1f} MB), first batch "
        f"{phases['first_batch_s']:.3f}s, first step {first_step}; downtime {downtime:.3f} s after detection"
    )
    return fields, summary, used_fired


_PARTS = ("state_collect_s", "recv_s", "verify_s", "state_restore_s")


def transfer_parts(recovered: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Where the slowest receiver's ``transfer_s`` went (its own tensors collected as the landing
    zone, the stream, the digests, the load into the model and optimizer); None when no rank
    received state."""
    receivers = [(r, x) for r, x in recovered.items() if x.get("role") == "receiver"]
    if not receivers:
        return None
    rank, x = max(receivers, key=lambda rx: float(rx[1].get("transfer_s", 0.0)))
    out: dict[str, Any] = {"rank": rank, "role": "receiver"}
    out.update({k: round(float(x[k]), 4) for k in _PARTS if isinstance(x.get(k), int | float)})
    return out
