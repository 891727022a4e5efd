"""The per-event costs of both recovery paths, and loading them from a JSON file.

Every field is a time in seconds, a bandwidth in GB/s (10^9 bytes per second) or the name of a
scaling model. The defaults are at-scale figures taken or derived from published reports; each
one's source is written in docs/goodput.md. A calibration file produced by this repository's
recovery benchmark may replace any of them: the file is a flat JSON object whose keys are the
field names below. Keys starting with ``_`` are ignored so a file can carry provenance notes.

Costs here are the parts that do *not* grow with the job size; the parts that do (communicator
start-up, checkpoint size over storage bandwidth, state per GPU over network bandwidth) are
computed in :mod:`checkpointless.simulate.models` from these numbers and the job's shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError

__all__ = ["Calibration", "CommModel", "calibration_from_mapping", "load_calibration"]


_OPTIONAL_FIELDS = ("shrink_s", "grow_s")
# more retries than this is a typo, not a setting: each one is a whole recovery round in the plan
_MAX_RETRIES = 1000


class CommModel(str, Enum):
    """How the time to form (or re-form) the job's communicator grows with the rank count N."""

    # Each rank publishes and reads peer addresses through one central key-value store: the
    # store serialises O(N) requests, which is what torch.distributed's TCPStore start-up does.
    STORE_LINEAR = "store-linear"
    # Ranks derive peer addresses from a table handed out in advance and exchange them along a
    # tree, so the critical path is O(log N) network round trips (HyperPod's root-less start-up).
    ROOTLESS_LOG = "rootless-log"
    # This repository's root-less rendezvous (docs/rendezvous.md) under gloo's full mesh
    # (CHECKPOINTLESS_GLOO_CONNECT=full), as benchmarks/rendezvous_scale.py measured it: each rank
    # serves its own keys and reads N keys from N owners, so the critical path is N times one
    # key's CPU cost plus a few round trips per batch of 128 keys. Only the key exchange: the
    # communicator's own connections are not in it.
    ROOTLESS_MEASURED = "rootless-measured"
    # The same store with gloo's lazy connection (comm/handle.py:gloo_connect, the launcher's
    # default): a rank reads, and connects to, only the peers its collectives use (its ring
    # neighbours and a barrier's log2(N) partners: plans.lazy_keys_read), and each key is read by
    # as many ranks, so the critical path is that many keys' CPU cost plus the barrier's rounds.
    ROOTLESS_LAZY = "rootless-lazy"
    # Shrink/grow of an existing communicator touches only the replaced ranks' neighbours (a
    # what-if: on gloo every generation is a new listener, so no rank's key can be kept).
    ROOTLESS_CONST = "rootless-const"


@dataclass(frozen=True)
class Calibration:
    """Costs of the two recovery paths and of saving a checkpoint (seconds, GB/s)."""

    # --- detection, shared by both paths ------------------------------------------------------
    detect_s: float = 10.0  # a crash or exception until every healthy rank knows
    hang_timeout_s: float = 300.0  # a hang is only noticed when a watchdog timeout fires

    # --- checkpointless: in-process recovery --------------------------------------------------
    abort_s: float = 5.0  # abort pending collectives, unwind the step, free framework state
    swap_s: float = 5.0  # hand the failed rank's identity to an already-started spare process
    rebuild_s: float = 2.0  # fixed part of re-forming the communicator (scaled part: models.py)
    # The launcher's default --rendezvous rootless (settings/job.py): every generation's store is
    # recovery/rendezvous_client.py:make_store's RootlessStore, each rank serving its own keys;
    # no store is left in the round (--rendezvous tcp, a TCPStore in the launcher, is STORE_LINEAR).
    # Its gloo groups connect lazily (comm/handle.py:gloo_connect, default lazy), so a rank reads
    # only its collectives' peers' keys; CHECKPOINTLESS_GLOO_CONNECT=full is ROOTLESS_MEASURED
    rebuild_model: CommModel = CommModel.ROOTLESS_LAZY
    # A checkpointless job that falls back is started again by the same launcher, whose first
    # generation forms through the same make_store and gloo groups: its restart is the same
    restart_model: CommModel = CommModel.ROOTLESS_LAZY
    # A step whose exception recurs is retried in the same process this many times, then the
    # job stops: recovery/recover.py:recover_from (max_step_retries=3, init()'s default), and the
    # coordinator's fault budget rules/budget.py:budget_verdict (--max-repeat-faults 3) and
    # ledger.py:check_progress (--max-step-failures 3) stop it at the same fourth raise
    step_retries: int = 3
    transfer_s: float = 1.0  # fixed part of a peer state transfer: handshake, checksums
    peer_gbps: float = 10.0  # effective per-GPU network bandwidth for the peer transfer
    data_resume_s: float = 1.0  # batches are served from the node-local cache, no cold start
    first_step_s: float = 10.0  # extra time of the first step after recovery (warm-up)
    step_overhead_s: float = 0.005  # steady cost per step of being recoverable (bookkeeping)

    # --- checkpoint-restart: the whole job is stopped and started again ------------------------
    requeue_s: float = 300.0  # kill every process, reschedule the job, start containers
    restart_s: float = 120.0  # process start, imports, model and optimizer construction
    init_s: float = 5.0  # fixed part of communicator initialisation (scaled part: models.py)
    init_model: CommModel = CommModel.STORE_LINEAR  # C-R: torchrun's TCPStore rendezvous
    store_per_rank_s: float = 0.01  # store-based start-up: seconds per rank (the O(N) term)
    rootless_log_s: float = 1.0  # root-less start-up: seconds per doubling of N (the log term)
    # rootless-measured: benchmarks/results/rendezvous_scale.json, max(s_o, s_r) = 187.9 us of CPU
    # per key (owner or reader, measured at 4,096 ranks), 3 round trips of 50 us per 128 keys
    rootless_per_rank_s: float = 1.879e-4
    rootless_rtt_s: float = 5e-5
    load_s: float = 5.0  # fixed part of a checkpoint load: metadata, opening files
    storage_read_gbps: float = 200.0  # aggregate read bandwidth of the checkpoint store
    restart_data_s: float = 60.0  # data loader cold start (workers, shuffle buffers, prefetch)
    restart_first_step_s: float = 60.0  # extra time of the first step after a restart (compile)

    # --- saving a checkpoint, paid by both (checkpointless saves less often) -------------------
    save_s: float = 2.0  # fixed blocking part of a save: barrier, metadata
    storage_write_gbps: float = 200.0  # aggregate write bandwidth of the checkpoint store

    # --- degraded mode: measured times replace the modelled round when given --------------------
    # None: each is one recovery round built from the costs above (models.shrink_phases and
    # grow_phases), until the benchmark measures them.
    shrink_s: float | None = None  # from detection to the first step with fewer replicas
    grow_s: float | None = None  # from a step boundary to the first step at full width again
    # One extra accumulation pass as a share of the full-width step (the forward and backward;
    # the all-reduce and the optimizer step run once): benchmarks/results/degraded_step.json,
    # 4 -> 3 ranks with a per-pass device stand-in, degraded step 1.8294x the full one (median of 3).
    extra_pass_ratio: float = 0.8294

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, CommModel) or (value is None and f.name in _OPTIONAL_FIELDS):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(
                    f"calibration {f.name}={value!r} is not a finite number; give seconds or GB/s"
                )
            if f.name.endswith("_gbps") and value <= 0:
                raise ConfigError(f"calibration {f.name}={value} must be > 0 GB/s")
            if value < 0:
                raise ConfigError(f"calibration {f.name}={value} is negative; costs are >= 0 seconds")
        if not isinstance(self.step_retries, int) or self.step_retries > _MAX_RETRIES:
            raise ConfigError(
                f"calibration step_retries={self.step_retries!r} must be a whole number of retries "
                f"from 0 to {_MAX_RETRIES}; e.g. 3 (the worker's max_step_retries)"
            )


_MODEL_FIELDS = ("rebuild_model", "restart_model", "init_model")


def calibration_from_mapping(data: dict[str, Any], base: Calibration | None = None) -> Calibration:
    """Return ``base`` (or the defaults) with the values named in ``data`` replaced.

    ``transfer_bytes`` is accepted next to ``transfer_s``: together they are one measured peer
    transfer, so they set the bandwidth (``peer_gbps``) and leave no separate fixed part, because
    the measurement already contains the handshake.
    """
    cal = base if base is not None else Calibration()
    known = {f.name for f in fields(Calibration)}
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key.startswith("_") or key == "transfer_bytes":
            continue
        if key not in known:
            raise ConfigError(
                f"unknown calibration key {key!r}; use one of {sorted(known)} "
                "(or prefix it with '_' to keep it as a note)"
            )
        if key in _MODEL_FIELDS:
            try:
                changes[key] = CommModel(value)
            except ValueError:
                raise ConfigError(
                    f"calibration {key}={value!r} is not a model; use one of {[m.value for m in CommModel]}"
                ) from None
        else:
            changes[key] = value
    if "transfer_bytes" in data:
        nbytes, secs = data["transfer_bytes"], data.get("transfer_s")
        if not isinstance(secs, (int, float)) or not isinstance(nbytes, (int, float)):
            raise ConfigError("calibration transfer_bytes needs a numeric transfer_s next to it")
        if secs <= 0 or nbytes <= 0:
            raise ConfigError(f"calibration transfer_bytes={nbytes}, transfer_s={secs} must both be > 0")
        changes["peer_gbps"] = nbytes / secs / 1e9
        changes["transfer_s"] = 0.0
    return replace(cal, **changes)


def load_calibration(path: str | Path, base: Calibration | None = None) -> Calibration:
    """Read a calibration JSON file (a flat object of the fields above)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"calibration file {str(p)!r} does not exist; run the recovery benchmark first"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"calibration file {str(p)!r} is not valid JSON ({e}); fix or regenerate it"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"calibration file {str(p)!r} must hold a JSON object of cost names to numbers")
    return calibration_from_mapping(data, base)
