"""A generator record's bytes (recovery/rng_record.py): the header spelled out without
``json.dumps`` must be the very bytes ``json.dumps`` wrote, whatever the scalars (a cached
Gaussian or none, odd floats, a section's name with quotes and non-ASCII letters), so records
written before and after read the same, and every record decodes back to what was kept."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch

from checkpointless.recovery.rng_record import RngRecord, decode_record, encode_record, record_point
from checkpointless.state.snapshot import capture_rng

pytestmark = pytest.mark.timeout(60)

_LEAD = struct.Struct("<8sII")  # the record's lead: magic, length, the header's length


def header_of(data: bytes) -> bytes:
    _, _, n = _LEAD.unpack_from(data)
    return data[_LEAD.size : _LEAD.size + n]


GAUSSES = [None, 0.0, -0.0, 1.5, -0.33087015189408764, 1e-310, 1e300, math.inf, math.nan]
SECTIONS = [None, "eval", 'say "hi"\\n', "évaluation ✓", "\x00\x1f"]


@pytest.mark.parametrize("py_gauss", GAUSSES)
@pytest.mark.parametrize("section", SECTIONS)
def test_the_header_is_the_bytes_json_dumps_wrote(py_gauss: float | None, section: str | None) -> None:
    rng = capture_rng()
    rng["python"] = [rng["python"][0], rng["python"][1], py_gauss]
    np_gauss = 0.0 if py_gauss is None else py_gauss
    rng["numpy"] = ["MT19937", rng["numpy"][1], 624, int(py_gauss is not None), np_gauss]
    for data, closing in ((None, None), (b"positions", None), (b"p", b"closing")):
        for step in (0, 7, 10**12):
            record = RngRecord(step, rng, section, data, closing)
            raw = encode_record(record)
            head = header_of(raw)
            # json.loads then json.dumps writes json.dumps's bytes of the same dict, in its order
            assert head == json.dumps(json.loads(head)).encode()
            assert list(json.loads(head)) == [
                "step", "section", "python", "numpy", "cuda", "data", "closing", "sizes"
            ]  # fmt: skip
            back = decode_record(raw)
            assert (back.step, back.section, back.data, back.closing) == (step, section, data, closing)
            assert record_point(raw) == (step, section)
            same = back.rng["python"][2] == py_gauss or (py_gauss is not None and math.isnan(py_gauss))
            assert same and torch.equal(back.rng["torch"], rng["torch"])
            assert np.array_equal(back.rng["numpy"][1], rng["numpy"][1])


def test_a_tensor_that_is_not_a_plain_cpu_one_is_still_encoded() -> None:
    """Generator states are plain contiguous CPU tensors; anything else takes the slow way."""
    rng = capture_rng()
    plain = encode_record(RngRecord(3, rng))
    strided = torch.zeros(2 * rng["torch"].numel(), dtype=torch.uint8)[::2]
    strided.copy_(rng["torch"])
    words = tuple(rng["python"][1].tolist())  # as random.getstate() gives them
    odd = {**rng, "torch": strided, "python": [rng["python"][0], words, rng["python"][2]]}
    assert encode_record(RngRecord(3, odd)) == plain
