"""Peer-to-peer state transfer, verified end to end.

Two transports carry the same layout (:mod:`checkpointless.state.codec`):

* a direct TCP stream per receiver, opened through the source's rendezvous key server
  (:mod:`checkpointless.state.stream`): the default under the root-less rendezvous, and the
  faster one;
* the generation's gloo group, when there is no key server to reach (``--rendezvous tcp``). Per
  receiver: a header (manifest length, message count), the manifest, every message with its own
  tag (so the receiver posts every receive at once), then a trailer with the XXH3-128 digests.
  The digests come last so that the first byte leaves at once: the sender hashes while gloo's
  I/O thread sends, the receiver hashes each message as soon as it has landed.

Either way a digest mismatch raises: a corrupted replica is a fault, never a warning.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from checkpointless.comm.communicator import Communicator
from checkpointless.comm.handle import Handle
from checkpointless.errors import StateTransferError
from checkpointless.state.arena import Arena
from checkpointless.state.codec import SOLO_MIN, digest, layout, mismatch, receive_buffers, unpack
from checkpointless.state.manifest import parse_manifest
from checkpointless.state.stream import StreamRoute, stream_receive, stream_send

__all__ = ["Arena", "StreamRoute", "receive_state", "send_state"]

_TAG_HEADER, _TAG_MANIFEST, _TAG_TRAILER, _TAG_MESSAGE = 7100, 7101, 7102, 7200
_DIGEST_LEN = 32  # hex characters of an XXH3-128 digest
_HASH_THREADS = 2


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def send_state(
    comm: Communicator,
    tree: Any,
    receivers: list[int],
    timeout: float,
    route: StreamRoute | None = None,
) -> dict[str, float]:
    """Send ``tree`` to every receiver; return timings and byte counts."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    # every tensor is a message of its own on the stream (they are just consecutive bytes there);
    # over gloo each message costs a work item and a thread, so small tensors are packed
    lay = layout(tree, solo_min=0 if route is not None else SOLO_MIN)
    mbytes = lay.manifest_bytes()
    t1 = time.monotonic()
    if route is not None:
        stream_send(route, lay, mbytes, receivers, deadline, lambda: comm.aborted)
    else:
        _send_gloo(comm, lay.messages, mbytes, receivers, deadline)
    t2 = time.monotonic()
    nbytes = sum(int(m.numel()) for m in lay.messages) + len(mbytes)
    return {
        "layout_s": t1 - t0,
        "send_s": t2 - t1,
        "bytes": float(nbytes),
        "messages": float(len(lay.messages)),
    }


def receive_state(
    comm: Communicator,
    src: int,
    timeout: float,
    into: Any = None,
    route: StreamRoute | None = None,
    arena: Arena | None = None,
) -> tuple[Any, dict[str, float]]:
    """Receive a tree from ``src``. Large tensors land in place in ``into``'s tensors of the same
    path, dtype and shape (pass the receiver's own current state): they are overwritten, so the
    receiver's old state is gone once this starts, verified or not. The others land in
    ``arena`` while it has room (a spare's memory, paged in while it waited)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    if route is not None:
        manifest, buffers, stats = stream_receive(
            route, src, comm.rank, deadline, lambda: comm.aborted, into, arena
        )
    else:
        manifest, buffers, stats = _receive_gloo(comm, src, deadline, into, arena)
    tree = unpack(manifest, buffers)
    # after the last byte: the digests still being compared, and the tree being rebuilt
    stats["verify_s"] = time.monotonic() - t0 - stats["recv_s"]
    return tree, stats


def _send_gloo(
    comm: Communicator, messages: list[torch.Tensor], mbytes: bytes, receivers: list[int], deadline: float
) -> None:
    header = torch.tensor([len(mbytes), len(messages)], dtype=torch.int64)
    mtensor = torch.frombuffer(bytearray(mbytes), dtype=torch.uint8)
    handles: list[Handle] = []
    with ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="cl-hash") as pool:
        for dst in receivers:
            handles.append(comm.send(header, dst, _TAG_HEADER))
            handles.append(comm.send(mtensor, dst, _TAG_MANIFEST))
            for i, msg in enumerate(messages):
                if msg.numel():
                    handles.append(comm.send(msg, dst, _TAG_MESSAGE + i))
        # hashing overlaps the sends: gloo's I/O threads carry the bytes meanwhile
        digests = [digest(mbytes), *pool.map(digest, messages)]
    trailer = torch.frombuffer(bytearray("".join(digests).encode()), dtype=torch.uint8)
    for dst in receivers:
        handles.append(comm.send(trailer, dst, _TAG_TRAILER))
    for h in handles:
        comm.wait(h, _left(deadline))


def _receive_gloo(
    comm: Communicator, src: int, deadline: float, into: Any, arena: Arena | None
) -> tuple[dict[str, Any], list[torch.Tensor], dict[str, float]]:
    t0 = time.monotonic()
    header = torch.empty(2, dtype=torch.int64)
    comm.wait(comm.recv(header, src, _TAG_HEADER), _left(deadline))
    mlen, nmsg = (int(x) for x in header.tolist())
    if not (0 < mlen < 1 << 31 and 0 <= nmsg < 1 << 24):
        raise StateTransferError(
            f"state header from rank {src} is implausible: {mlen} bytes, {nmsg} messages"
        )
    mtensor = torch.empty(mlen, dtype=torch.uint8)
    comm.wait(comm.recv(mtensor, src, _TAG_MANIFEST), _left(deadline))
    mbytes = bytes(mtensor.numpy())
    manifest = parse_manifest(mbytes)  # checked before any buffer is allocated from it
    if len(manifest.get("messages", ())) != nmsg:
        raise StateTransferError(f"state manifest from rank {src} does not match its header")
    buffers, in_place = receive_buffers(manifest, into, arena)
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
    sent = bytes(trailer.numpy()).decode("ascii", "replace")
    bad = mismatch(got, [sent[i : i + _DIGEST_LEN] for i in range(0, len(sent), _DIGEST_LEN)])
    if bad is not None:
        raise StateTransferError(f"state from rank {src}: {bad}")
    nbytes = sum(int(b.numel()) for b in buffers) + mlen
    return manifest, buffers, {"recv_s": t1 - t0, "bytes": float(nbytes), "in_place_bytes": float(in_place)}
