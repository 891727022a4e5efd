"""Lay a tree of Python values and tensors out as a JSON manifest plus a list of byte messages.

Why not ``torch.save``/pickle: the bytes come from another process over the network, and
unpickling them would run whatever they say. The manifest is JSON (the only Python types it can
carry are explicit) and tensors travel as raw bytes.

Why a list of messages and not one flat buffer: copying the whole state into one new buffer
costs a pass over memory plus a page fault per 4 KiB on the sender, and the same again on the
receiver. Here a tensor is its own message, sent straight from the tensor's memory, and received
straight into the receiver's own tensor of the same name when it has one (a survivor that fell
behind, a spare whose model exists): bytes go from one replica's tensor to the other's with no
copy on either side. A transport with a real cost per message (gloo) asks for small tensors (RNG
states, step counters, biases) to be packed into a few buffers instead.

Each message is checksummed with XXH3-128 (~10 GB/s per core, so it overlaps the wire instead
of adding to it): it detects corruption, not forgery (the bytes travel only between members of
one job, over connections set up through the authenticated rendezvous).

Round trips are exact: floats through ``repr`` (JSON keeps every bit, NaN and infinities
included), tuples and non-string dict keys are tagged so an optimizer's ``param_groups`` or
``state`` dict come back with the same types.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from checkpointless.errors import StateTransferError
from checkpointless.state.arena import Arena, new_tensor

__all__ = [
    "Layout",
    "digest",
    "encode",
    "layout",
    "mismatch",
    "receive_buffers",
    "tensor_meta",
    "tensor_paths",
    "unpack",
]

_ALIGN = 64  # every packed tensor starts on a 64-byte boundary
SOLO_MIN = 1 << 20  # by default tensors this large travel as their own message, in place
_ARENA_MIN = 64 << 10  # smaller tensors get storage of their own (see unpack), not arena space
_PACK_MAX = 16 << 20  # a pack of small tensors is cut at this size


@dataclass
class Layout:
    """What the sender announces (``manifest``) and the byte messages it then sends, in order."""

    manifest: dict[str, Any]
    messages: list[torch.Tensor]  # uint8, contiguous; large tensors are views of the state itself
    # a staged layout's messages may lie on a GPU: the events after which they hold the step's
    # state (state/device_copy.py); None: every message is in host memory
    ready: list[Any] | None = None

    def manifest_bytes(self) -> bytes:
        return json.dumps(self.manifest, separators=(",", ":"), allow_nan=True).encode()


def digest(buf: torch.Tensor | bytes) -> str:
    """XXH3-128 of one message (xxhash releases the GIL, so messages hash in parallel)."""
    data = buf if isinstance(buf, bytes) else memoryview(buf.numpy()).cast("B")
    return xxhash.xxh3_128(data).hexdigest()


def mismatch(got: list[str], expected: Any) -> str | None:
    """None when every digest matches; otherwise what differs, for the error."""
    if not isinstance(expected, list) or len(expected) != len(got):
        n = len(expected) if isinstance(expected, list) else "no"
        return f"the sender announced {n} digests for {len(got)} parts"
    bad = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    if not bad:
        return None
    what = "manifest" if bad[0] == 0 else f"message {bad[0] - 1}"
    return (
        f"checksum mismatch in the {what} ({len(bad)} of {len(got)} parts): "
        f"received xxh3 {got[bad[0]][:16]}..., sender had {str(expected[bad[0]])[:16]}..."
    )


def _walk(tree: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``tree`` with its path; the sender and the receiver name tensors alike."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _walk(v, f"{path}/{k!r}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _walk(v, f"{path}/{i}")


def tensor_paths(tree: Any) -> dict[str, torch.Tensor]:
    return dict(_walk(tree))


def as_byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor: a view when it is a contiguous CPU tensor."""
    if t.requires_grad:  # (asked first: a detach per tensor is most of this on every step)
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # the state group is gloo: device tensors travel through host memory
    return t.contiguous().reshape(-1).view(torch.uint8)


def encode(tree: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """The manifest's ``tree`` (each tensor replaced by its index) and the tensors, with their
    paths, in that order."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def enc(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append((path, v))
            return {"__t": len(tensors) - 1}
        if isinstance(v, np.ndarray):
            tensors.append((path, torch.from_numpy(np.ascontiguousarray(v))))
            return {"__np": len(tensors) - 1}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, tuple):
            return {"__tuple": [enc(x, f"{path}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, f"{path}/{i}") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: enc(x, f"{path}/{k!r}") for k, x in v.items()}
            return {"__dict": [[enc(k, path), enc(x, f"{path}/{k!r}")] for k, x in v.items()]}
        if isinstance(v, (np.integer, np.floating, np.bool_)):
            return {"__npscalar": [str(v.dtype), v.item()]}
        if isinstance(v, torch.dtype):
            return {"__dtype": str(v).removeprefix("torch.")}
        raise StateTransferError(
            f"cannot transfer a value of type {type(v).__name__}: registered state must be "
            "tensors, numbers, strings, lists, tuples and dicts (give your object a "
            "state_dict()/load_state_dict() that returns those)"
        )

    return enc(tree, ""), tensors


def tensor_meta(path: str, t: torch.Tensor) -> dict[str, Any]:
    """A tensor's entry in the manifest, without where it lies (``msg``, ``offset``, ``solo``)."""
    return {
        "path": path,
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "nbytes": t.numel() * t.element_size(),
    }


def layout(
    tree: Any, solo_min: int = SOLO_MIN, as_bytes: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Layout:
    """Lay ``tree`` out. Tensors of ``solo_min`` bytes or more are messages of their own (sent from
    and received into tensor memory); smaller ones are packed. A transport whose messages are
    cheap (the stream) passes 0: then nothing is copied at all. ``as_bytes`` replaces how a solo
    tensor's bytes are viewed (a caller that lays out the same tensors every step remembers them)."""
    to_bytes = as_byte_view if as_bytes is None else as_bytes
    skeleton, tensors = encode(tree)
    metas: list[dict[str, Any]] = []
    messages: list[torch.Tensor] = []
    packs: list[list[tuple[int, torch.Tensor]]] = []  # per pack: (offset, tensor)
    pack_msgs: list[int] = []  # which messages are packs
    pack_end = _PACK_MAX  # forces a new pack for the first small tensor
    for path, t in tensors:
        meta = tensor_meta(path, t)
        nbytes = meta["nbytes"]
        if nbytes >= solo_min:
            meta.update(msg=len(messages), offset=0, solo=True)
            messages.append(to_bytes(t))
        else:
            if pack_end + nbytes > _PACK_MAX:
                packs.append([])
                pack_msgs.append(len(messages))
                messages.append(torch.empty(0, dtype=torch.uint8))  # filled below
                pack_end = 0
            meta.update(
                msg=pack_msgs[-1], offset=pack_end, solo=False
            )  # not len-1: a solo may follow the pack
            packs[-1].append((pack_end, t))
            pack_end += -(-nbytes // _ALIGN) * _ALIGN
        metas.append(meta)
    # fill the packs: zeros first, so the padding is hashed as zeros
    for i, items in zip(pack_msgs, packs, strict=True):
        size = max(off + t.numel() * t.element_size() for off, t in items) if items else 0
        buf = torch.zeros(-(-size // _ALIGN) * _ALIGN, dtype=torch.uint8)
        for off, t in items:
            n = t.numel() * t.element_size()
            if n:
                buf[off : off + n].copy_(as_byte_view(t))
        messages[i] = buf
    manifest = {"tree": skeleton, "tensors": metas, "messages": [int(m.numel()) for m in messages]}
    return Layout(manifest, messages)


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise StateTransferError(f"state manifest names an unknown dtype {name!r}")
    return dt


def receive_buffers(
    manifest: dict[str, Any], into: Any = None, arena: Arena | None = None
) -> tuple[list[torch.Tensor], int]:
    """One uint8 buffer per message to receive into, and how many bytes of them are ``into``'s.

    A large tensor lands straight in the receiver's own tensor at the same path (``into``, e.g.
    its current state) when that tensor has the same dtype and shape and lives contiguous on the
    CPU; otherwise in memory from ``arena`` (paged in ahead), or else in a new tensor."""
    own = tensor_paths(into) if into is not None else {}
    used: set[int] = set()  # tied weights appear under two paths: fill the memory only once
    buffers: list[torch.Tensor] = []
    in_place = 0
    sizes = [int(n) for n in manifest["messages"]]
    solo = {int(m["msg"]): m for m in manifest["tensors"] if m["solo"]}
    for i, n in enumerate(sizes):
        m = solo.get(i)
        if m is None:
            buffers.append(new_tensor(torch.uint8, (n,)))
            continue
        dtype, shape = _dtype(m["dtype"]), tuple(int(s) for s in m["shape"])
        dst = own.get(m["path"])
        if (
            dst is None
            or dst.dtype != dtype
            or tuple(dst.shape) != shape
            or dst.device.type != "cpu"
            or not dst.is_contiguous()
            or dst.data_ptr() in used
        ):
            dst = arena.take(dtype, shape) if arena is not None and n >= _ARENA_MIN else None
            if dst is None:
                dst = new_tensor(dtype, shape)
        else:
            in_place += n
        used.add(dst.data_ptr())
        buf = dst.detach().reshape(-1).view(torch.uint8)
        if buf.numel() != n:
            raise StateTransferError(f"state message {i} is {n} bytes, its tensor needs {buf.numel()}")
        buffers.append(buf)
    return buffers, in_place


def unpack(manifest: dict[str, Any], messages: list[torch.Tensor]) -> Any:
    """Rebuild the tree from received (and already verified) messages."""
    metas = manifest["tensors"]
    if len(messages) != len(manifest["messages"]):
        raise StateTransferError(
            f"state has {len(messages)} messages, the sender announced {len(manifest['messages'])}"
        )

    def tensor(i: int) -> torch.Tensor:
        m = metas[i]
        dtype, shape = _dtype(m["dtype"]), [int(s) for s in m["shape"]]
        buf = messages[int(m["msg"])]
        off, n = int(m["offset"]), int(m["nbytes"])
        if off + n > buf.numel():
            raise StateTransferError(f"state tensor {m['path']} lies outside its message")
        raw = buf[off : off + n]
        if not m["solo"]:
            # packed tensors get storage of their own: some consumers (torch.set_rng_state) read
            # a tensor's storage from its start and would see the pack's first bytes instead
            raw = raw.clone()
        return raw.view(dtype).reshape(shape)

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
                return _dtype(v["__dtype"])
            return {k: dec(x) for k, x in v.items()}
        return v

    return dec(manifest["tree"])


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k
