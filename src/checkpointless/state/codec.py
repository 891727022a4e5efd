"""Encode a tree of Python values and tensors as a JSON manifest plus one flat byte buffer.

Why not ``torch.save``/pickle: the bytes come from another process over the network, and
unpickling them would run whatever they say. The manifest is JSON (the only Python types it can
carry are explicit), tensors travel as raw bytes at recorded offsets, and the whole thing is
checksummed so the receiver knows it holds exactly what the sender had. The checksum is a tree
of XXH3-128 digests: it detects corruption, not forgery (the bytes only ever travel between
members of one job, over connections set up through the authenticated rendezvous), and at
~13 GB/s per core it costs a fraction of the wire time, where SHA-256 here ran at 1.6 GB/s.

Round trips are exact: floats through ``repr`` (JSON keeps every bit, NaN and infinities
included), tuples and non-string dict keys are tagged so an optimizer's ``param_groups`` or
``state`` dict come back with the same types.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from checkpointless.errors import StateTransferError

__all__ = ["EncodedState", "decode", "digest_buffer", "encode"]

_CHUNK = 16 << 20  # hash in 16 MiB chunks on a few threads; xxhash releases the GIL
_ALIGN = 64  # every tensor starts on a 64-byte boundary, so the receiver can view it in place
_VIEW_MIN = 1 << 20


@dataclass
class EncodedState:
    manifest: dict[str, Any]
    payload: torch.Tensor  # uint8, contiguous

    def manifest_bytes(self) -> bytes:
        return json.dumps(self.manifest, separators=(",", ":"), allow_nan=True).encode()


def digest_buffer(buf: torch.Tensor) -> str:
    """XXH3-128 tree hash of a uint8 tensor: chunk digests hashed together, in parallel."""
    view = memoryview(buf.numpy()).cast("B")
    n = len(view)
    starts = range(0, max(n, 1), _CHUNK)

    def h(s: int) -> bytes:
        return xxhash.xxh3_128(view[s : s + _CHUNK]).digest()

    if n > 2 * _CHUNK:
        with ThreadPoolExecutor(max_workers=4) as ex:
            parts = list(ex.map(h, starts))
    else:
        parts = [h(s) for s in starts]
    top = xxhash.xxh3_128(n.to_bytes(8, "little"))
    for p in parts:
        top.update(p)
    return top.hexdigest()


def encode(tree: Any) -> EncodedState:
    tensors: list[torch.Tensor] = []

    def enc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v.detach())
            return {"__t": len(tensors) - 1}
        if isinstance(v, np.ndarray):
            tensors.append(torch.from_numpy(np.ascontiguousarray(v)))
            return {"__np": len(tensors) - 1}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, tuple):
            return {"__tuple": [enc(x) for x in v]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: enc(x) for k, x in v.items()}
            return {"__dict": [[enc(k), enc(x)] for k, x in v.items()]}
        if isinstance(v, (np.integer, np.floating, np.bool_)):
            return {"__npscalar": [str(v.dtype), v.item()]}
        if isinstance(v, torch.dtype):
            return {"__dtype": str(v).removeprefix("torch.")}
        raise StateTransferError(
            f"cannot transfer a value of type {type(v).__name__}: registered state must be "
            "tensors, numbers, strings, lists, tuples and dicts (give your object a "
            "state_dict()/load_state_dict() that returns those)"
        )

    skeleton = enc(tree)
    metas = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append(
            {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
                "device": t.device.type,
            }
        )
        offset += -(-nbytes // _ALIGN) * _ALIGN
    payload = torch.zeros(offset, dtype=torch.uint8)  # zeros: the padding is hashed too
    for t, m in zip(tensors, metas, strict=True):
        if m["nbytes"]:
            src = t.contiguous().cpu().reshape(-1).view(torch.uint8)
            payload[m["offset"] : m["offset"] + m["nbytes"]].copy_(src)
    manifest = {"tree": skeleton, "tensors": metas, "payload_bytes": offset, "xxh3": digest_buffer(payload)}
    return EncodedState(manifest, payload)


def decode(manifest: dict[str, Any], payload: torch.Tensor, verify: bool = True) -> Any:
    """Rebuild the tree. With ``verify`` the payload's digest must match the sender's."""
    if payload.numel() != manifest["payload_bytes"]:
        raise StateTransferError(
            f"state payload is {payload.numel()} bytes, the sender announced {manifest['payload_bytes']}"
        )
    if verify:
        got = digest_buffer(payload)
        if got != manifest["xxh3"]:
            raise StateTransferError(
                f"state checksum mismatch: received xxh3 {got[:16]}…, sender had {manifest['xxh3'][:16]}…"
            )
    metas = manifest["tensors"]

    def tensor(i: int) -> torch.Tensor:
        m = metas[i]
        dtype = getattr(torch, m["dtype"])
        raw = payload[m["offset"] : m["offset"] + m["nbytes"]]
        if m["nbytes"] < _VIEW_MIN:
            # small tensors get storage of their own: some consumers (torch.set_rng_state) read a
            # tensor's storage from its start and would see the buffer's first bytes instead
            raw = raw.clone()
        # large ones stay views into the received buffer: load_state_dict copies them anyway
        return raw.view(dtype).reshape(m["shape"])

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if isinstance(v, dict):
            if "__t" in v:
                return tensor(v["__t"])
            if "__np" in v:
                return tensor(v["__np"]).numpy()
            if "__tuple" in v:
                return tuple(dec(x) for x in v["__tuple"])
            if "__dict" in v:
                return {_hashable(dec(k)): dec(x) for k, x in v["__dict"]}
            if "__npscalar" in v:
                dt, val = v["__npscalar"]
                return np.dtype(dt).type(val)
            if "__dtype" in v:
                return getattr(torch, v["__dtype"])
            return {k: dec(x) for k, x in v.items()}
        return v

    return dec(manifest["tree"])


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k
