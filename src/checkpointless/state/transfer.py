"""Peer-to-peer state transfer over the job's communicator, verified end to end.

The source encodes its state once (manifest + flat payload with an XXH3-128 tree hash) and sends
it to each receiver: first the sizes, then the manifest bytes, then the payload, each as one
point-to-point message on the freshly built generation. The receiver recomputes the digest and
refuses (raises) on any mismatch: a corrupted replica is a fault, never a warning.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from checkpointless.comm.communicator import Communicator
from checkpointless.errors import StateTransferError
from checkpointless.state.codec import EncodedState, decode, encode

__all__ = ["receive_state", "send_state"]

_TAG = 7100


def send_state(comm: Communicator, tree: Any, receivers: list[int], timeout: float) -> dict[str, float]:
    """Send ``tree`` to every receiver; return timings and byte counts."""
    t0 = time.monotonic()
    enc: EncodedState = encode(tree)
    mbytes = enc.manifest_bytes()
    t1 = time.monotonic()
    sizes = torch.tensor([len(mbytes), enc.payload.numel()], dtype=torch.int64)
    mtensor = torch.frombuffer(bytearray(mbytes), dtype=torch.uint8)
    deadline = time.monotonic() + timeout
    for dst in receivers:
        handles = [
            comm.send(sizes, dst, _TAG),
            comm.send(mtensor, dst, _TAG + 1),
            comm.send(enc.payload, dst, _TAG + 2),
        ]
        for h in handles:
            comm.wait(h, max(0.1, deadline - time.monotonic()))
    t2 = time.monotonic()
    return {"encode_s": t1 - t0, "send_s": t2 - t1, "bytes": float(enc.payload.numel() + len(mbytes))}


def receive_state(comm: Communicator, src: int, timeout: float) -> tuple[Any, dict[str, float]]:
    t0 = time.monotonic()
    deadline = t0 + timeout
    sizes = torch.empty(2, dtype=torch.int64)
    comm.wait(comm.recv(sizes, src, _TAG), timeout)
    mlen, plen = (int(x) for x in sizes.tolist())
    mtensor = torch.empty(mlen, dtype=torch.uint8)
    payload = torch.empty(plen, dtype=torch.uint8)
    h1 = comm.recv(mtensor, src, _TAG + 1)
    h2 = comm.recv(payload, src, _TAG + 2)
    comm.wait(h1, max(0.1, deadline - time.monotonic()))
    comm.wait(h2, max(0.1, deadline - time.monotonic()))
    t1 = time.monotonic()
    try:
        manifest = json.loads(bytes(mtensor.numpy()))
    except ValueError as e:
        raise StateTransferError(f"state manifest from rank {src} is not valid JSON: {e}") from e
    tree = decode(manifest, payload, verify=True)
    t2 = time.monotonic()
    return tree, {"recv_s": t1 - t0, "verify_s": t2 - t1, "bytes": float(plen + mlen)}
