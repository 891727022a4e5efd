"""Peer-to-peer state transfer over the job's communicator, verified end to end.

The protocol, per receiver, on the freshly built generation (each step a point-to-point message
with its own tag, so the receiver can post every receive at once):

1. a header: the manifest's length and the number of messages;
2. the manifest (JSON: the tree, where each tensor lies, the message sizes);
3. the messages: large tensors straight from the sender's memory, small ones in packs;
4. a trailer: the XXH3-128 digest of the manifest and of every message.

The digests come last so that the first byte leaves at once: the sender hashes while gloo's I/O
thread sends, and the receiver hashes each message as soon as it has landed, while the next one
is still on the wire. A mismatch raises: a corrupted replica is a fault, never a warning.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from checkpointless.comm.communicator import Communicator, Handle
from checkpointless.errors import StateTransferError
from checkpointless.state.codec import digest, layout, receive_buffers, unpack

__all__ = ["receive_state", "send_state"]

_TAG_HEADER, _TAG_MANIFEST, _TAG_TRAILER, _TAG_MESSAGE = 7100, 7101, 7102, 7200
_DIGEST_LEN = 32  # hex characters of an XXH3-128 digest
_HASH_THREADS = 2


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def send_state(comm: Communicator, tree: Any, receivers: list[int], timeout: float) -> dict[str, float]:
    """Send ``tree`` to every receiver; return timings and byte counts."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    lay = layout(tree)
    mbytes = lay.manifest_bytes()
    header = torch.tensor([len(mbytes), len(lay.messages)], dtype=torch.int64)
    mtensor = torch.frombuffer(bytearray(mbytes), dtype=torch.uint8)
    t1 = time.monotonic()
    handles: list[Handle] = []
    with ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="cl-hash") as pool:
        for dst in receivers:
            handles.append(comm.send(header, dst, _TAG_HEADER))
            handles.append(comm.send(mtensor, dst, _TAG_MANIFEST))
            for i, msg in enumerate(lay.messages):
                if msg.numel():
                    handles.append(comm.send(msg, dst, _TAG_MESSAGE + i))
        # hashing overlaps the sends: gloo's I/O threads carry the bytes meanwhile
        digests = [digest(mbytes), *pool.map(digest, lay.messages)]
    trailer = torch.frombuffer(bytearray("".join(digests).encode()), dtype=torch.uint8)
    for dst in receivers:
        handles.append(comm.send(trailer, dst, _TAG_TRAILER))
    for h in handles:
        comm.wait(h, _left(deadline))
    t2 = time.monotonic()
    nbytes = sum(int(m.numel()) for m in lay.messages) + len(mbytes)
    return {
        "layout_s": t1 - t0,
        "send_s": t2 - t1,
        "bytes": float(nbytes),
        "messages": float(len(lay.messages)),
    }


def receive_state(
    comm: Communicator, src: int, timeout: float, into: Any = None
) -> tuple[Any, dict[str, float]]:
    """Receive a tree from ``src``. Large tensors land in place in ``into``'s tensors of the same
    path, dtype and shape (pass the receiver's own current state): they are overwritten, so the
    receiver's old state is gone once this starts, verified or not."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    header = torch.empty(2, dtype=torch.int64)
    comm.wait(comm.recv(header, src, _TAG_HEADER), timeout)
    mlen, nmsg = (int(x) for x in header.tolist())
    if not (0 < mlen < 1 << 31 and 0 <= nmsg < 1 << 24):
        raise StateTransferError(
            f"state header from rank {src} is implausible: {mlen} bytes, {nmsg} messages"
        )
    mtensor = torch.empty(mlen, dtype=torch.uint8)
    comm.wait(comm.recv(mtensor, src, _TAG_MANIFEST), _left(deadline))
    mbytes = bytes(mtensor.numpy())
    try:
        manifest = json.loads(mbytes)
    except ValueError as e:
        raise StateTransferError(f"state manifest from rank {src} is not valid JSON: {e}") from e
    if len(manifest.get("messages", ())) != nmsg:
        raise StateTransferError(f"state manifest from rank {src} does not match its header")
    buffers, in_place = receive_buffers(manifest, into)
    handles = {i: comm.recv(b, src, _TAG_MESSAGE + i) for i, b in enumerate(buffers) if b.numel()}
    trailer = torch.empty(_DIGEST_LEN * (nmsg + 1), dtype=torch.uint8)
    h_trailer = comm.recv(trailer, src, _TAG_TRAILER)
    futures: list[Future[str]] = []
    with ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="cl-hash") as pool:
        futures.append(pool.submit(digest, mbytes))
        for i, b in enumerate(buffers):
            if i in handles:
                comm.wait(handles[i], _left(deadline))
            futures.append(pool.submit(digest, b))  # hashed while the next message arrives
        comm.wait(h_trailer, _left(deadline))
        t1 = time.monotonic()
        got = [f.result() for f in futures]
    t2 = time.monotonic()
    sent = bytes(trailer.numpy()).decode("ascii", "replace")
    expected = [sent[i : i + _DIGEST_LEN] for i in range(0, len(sent), _DIGEST_LEN)]
    bad = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    if bad:
        what = "manifest" if bad[0] == 0 else f"message {bad[0] - 1}"
        raise StateTransferError(
            f"state checksum mismatch from rank {src} in the {what} ({len(bad)} of {len(got)} parts): "
            f"received xxh3 {got[bad[0]][:16]}..., sender had {expected[bad[0]][:16]}..."
        )
    tree = unpack(manifest, buffers)
    t3 = time.monotonic()
    nbytes = sum(int(b.numel()) for b in buffers) + mlen
    return tree, {
        "recv_s": t1 - t0,
        "verify_s": t3 - t1,
        "verify_tail_s": t2 - t1,
        "bytes": float(nbytes),
        "in_place_bytes": float(in_place),
    }
