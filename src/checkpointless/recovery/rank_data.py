"""Every rank's own data positions, kept with its generator records, so a rank that receives
its replica's state resumes its own position, not the sender's.

What is per-rank and not a function of the step. A ``DataLoader`` under ``job.loader()`` finds
step ``s``'s batch by index arithmetic from the step and its own sampler's rank
(recovery/loader.py), and a ``BatchLoader`` computes it from ``(step, dp_rank)``: a replacement
needs nothing of its predecessor's for those. A torchdata ``StatefulDataLoader`` under
``job.loader()`` is placed by its own state (recovery/stateful_loader.py), and that state may
differ per rank: a ``shuffle=True`` loader's sampler draws its generator's seed from the global
generator, which a script seeds per rank (``1337 + rank``), and an iterable dataset's state may
be an offset in the rank's own file. Its positions travel with the replica's state, so before
this a rank that received state loaded the *sender's* positions: another permutation, silently.

So each record that rank_rng.py keeps (in the job's shared memory, and with the rank's keeper
on another host) also carries the positions of this rank's stateful loaders as they stood at
that point (:meth:`LoaderPositions.capture`, encoded by the state codec: JSON and raw tensor
bytes, never pickle). A rank that receives its replica's state (a replacement, a survivor whose
update was cut short) or restores rank 0's snapshot then loads its own record's positions over
the received ones (:meth:`LoaderPositions.restore`), where the record holds a position of the
step it resumes at for every loader; otherwise the received positions stay, as before.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from checkpointless.errors import StateTransferError
from checkpointless.events import get_logger
from checkpointless.recovery.stateful_loader import StatefulStepLoader
from checkpointless.state.codec import layout, unpack

__all__ = ["MAX_POSITIONS", "LoaderPositions", "decode_positions", "encode_positions"]

log = get_logger()

_HEAD = struct.Struct("<I")  # the manifest's length
# a record larger than this is not kept (a keeper refuses records over rank_rng_peer's limit):
# loader states are a few hundred bytes to a few KB, worker states included
MAX_POSITIONS = 4 << 20


def encode_positions(tree: Any) -> bytes:
    """``tree`` (dicts, lists, numbers, strings, tensors) as bytes: the codec's JSON manifest, then
    its packed tensors."""
    lay = layout(tree, solo_min=1 << 62)  # everything packed: small states, one buffer or two
    head = lay.manifest_bytes()
    parts = [_HEAD.pack(len(head)), head]
    parts += [m.numpy().tobytes() for m in lay.messages]
    return b"".join(parts)


def decode_positions(data: bytes) -> Any:
    """The tree :func:`encode_positions` wrote.

    Raises:
        ValueError: ``data`` is not such a tree."""
    try:
        (n,) = _HEAD.unpack_from(data)
        manifest = json.loads(data[_HEAD.size : _HEAD.size + n])
        at = _HEAD.size + n
        messages: list[torch.Tensor] = []
        for size in manifest["messages"]:
            chunk = data[at : at + int(size)]
            if len(chunk) != int(size):
                raise ValueError("data positions cut short")
            # (frombuffer refuses an empty buffer: an empty pack is an empty tensor)
            empty = torch.empty(0, dtype=torch.uint8)
            messages.append(torch.frombuffer(bytearray(chunk), dtype=torch.uint8) if chunk else empty)
            at += int(size)
        return unpack(manifest, messages)
    except (struct.error, KeyError, TypeError, StateTransferError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed data positions: {e}") from e


class LoaderPositions:
    """This rank's stateful loaders by their tracked names: their positions taken for each record,
    and put back from a record."""

    def __init__(self) -> None:
        self._loaders: dict[str, StatefulStepLoader] = {}
        self._cached: tuple[tuple[Any, ...], bytes | None] | None = None  # (the loaders' versions, bytes)
        self._refused = False  # said once: a state the codec cannot carry is not kept

    def add(self, name: str, loader: StatefulStepLoader) -> None:
        self._loaders[name] = loader
        self._cached = None

    def __bool__(self) -> bool:
        return bool(self._loaders)

    def capture(self) -> bytes | None:
        """The positions of every registered loader as they stand, encoded (the same bytes again
        while no loader has moved: a step's several records cost one capture)."""
        versions = tuple(loader.version for loader in self._loaders.values())
        if self._cached is not None and self._cached[0] == versions:
            return self._cached[1]
        data: bytes | None
        try:
            data = encode_positions({name: loader.state_dict() for name, loader in self._loaders.items()})
        except StateTransferError as e:
            data = None
            if not self._refused:
                self._refused = True
                log.warning("this rank's loader positions are not kept for its replacement: %s", e)
        if data is not None and len(data) > MAX_POSITIONS:
            if not self._refused:
                self._refused = True
                log.warning(
                    "this rank's loader positions are %d bytes, more than the %d a record carries: not "
                    "kept for its replacement (it takes its replica's)",
                    len(data),
                    MAX_POSITIONS,
                )
            data = None
        self._cached = (versions, data)
        return data

    def restore(self, data: bytes | None, step: int) -> bool:
        """Load this rank's own positions (a record's ``data``) into its loaders, over what they
        received, when the record has a position of ``step`` for every one of them; False (and
        nothing loaded) otherwise."""
        if data is None or not self._loaders:
            return False
        try:
            tree = decode_positions(data)
        except ValueError as e:
            log.warning("this rank's kept loader positions are unreadable (%s): keeping the received ones", e)
            return False
        if not isinstance(tree, dict) or set(tree) != set(self._loaders):
            return False
        if not all(_has_step(state, step) for state in tree.values()):
            return False
        for name, loader in self._loaders.items():
            loader.load_state_dict(tree[name])
        return True


def _has_step(state: Any, step: int) -> bool:
    positions = state.get("positions") if isinstance(state, dict) else None
    return isinstance(positions, list) and any(
        isinstance(p, dict) and p.get("step") in (step, None) for p in positions
    )
