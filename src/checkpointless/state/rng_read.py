"""Reading Python's and NumPy's global generators without their public getters' cost.

A rank reads its global generators several times a step (state/snapshot.py's ``capture_rng`` as
a step begins and as its first collective is issued; recovery/rng_compare.py's checks that
nothing drew since a record). The public getters build Python objects one word at a time:
``np.random.get_state()`` fills a 624-word array through Python item assignment (~100-180 µs
on the development machine) and ``random.getstate()`` builds a tuple of 625 ints (~40 µs), more
than all the rest of keeping a rank's own state (benchmarks/rank_rng.py).

Both generators keep their state in one C struct, so it is read here in one copy of its bytes:

- NumPy's legacy ``RandomState`` (behind ``np.random.*``): the Mersenne Twister's 624 key words
  and position, where its bit generator's public ``ctypes.state_address`` points, and the cached
  Gaussian (``has_gauss``, ``gauss``: a ``normal()`` draw keeps the second of each pair for the
  next call), which has no public read but ``get_state()`` and lives in the ``RandomState``
  object itself (its ``aug_bitgen_t``, right after the ``bitgen_t`` whose first field is that
  same state address, and which points back to it).
- Python's ``random`` (``random._inst``): its C ``RandomObject``'s position and 624 words; the
  cached Gaussian (``gauss_next``) is an ordinary attribute.

Nothing is assumed blindly. The layout is found once per process on private generators of the
same types (never the global ones, which are not touched): NumPy's fields by following its
pointers, Python's at the C struct's offsets; then the private generators are set to states with
and without a cached Gaussian, read both ways, and compared; and the global generators are
checked the same way (their pointers, and one read both ways) before the fast read is used for
them. If anything differs (another NumPy or Python, another interpreter), every read falls back
to the public getters, with the same results, only slower. The values read are identical to the
getters' (tests/unit/state/test_rng_read.py), so a state read here restores through the public
setters to the identical streams.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["numpy_gauss", "numpy_state", "python_getstate", "python_state", "reads_fast"]

_WORDS = 624  # both generators are the 32-bit Mersenne Twister: 624 words of state
_MT = struct.Struct(f"@{_WORDS}Ii")  # NumPy's mt19937_state: key[624], pos
_AUG = struct.Struct("@Pid")  # NumPy's aug_bitgen_t: its bitgen_t pointer, has_gauss, gauss
_PY = struct.Struct(f"@i{_WORDS}I")  # CPython's RandomObject after its header: index, state[624]


class _Window:
    """A fixed span of an object's memory, read in one copy. ``owner`` is held, so the span
    stays valid memory as long as the window lives."""

    def __init__(self, owner: object, address: int, size: int) -> None:
        self.owner = owner
        self.address = address
        self._span = (ctypes.c_char * size).from_address(address)

    def read(self) -> bytes:
        # one memcpy into a new bytes object with the GIL held: no Python-level draw runs
        # halfway through it
        return self._span.raw


class _NumpyReader:
    """Reads a ``RandomState``'s Mersenne Twister state and cached Gaussian directly."""

    def __init__(self, rs: Any, bitgen: int, aug: int) -> None:
        self.rs = rs
        self.bitgen, self.aug = bitgen, aug  # the offsets of its bitgen_t and aug_bitgen_t
        self._head = _Window(rs, id(rs) + bitgen, aug + _AUG.size - bitgen)
        self._state: _Window | None = None  # its bit generator's state, once seen

    def read(self) -> tuple[bytes, int, float] | None:
        """The key words and position (as bytes), ``has_gauss`` and ``gauss``; None if the
        generator no longer draws from a Mersenne Twister's state as found (a script gave it
        another bit generator: ``np.random.set_bit_generator``)."""
        head = self._head.read()
        (state_at,) = struct.unpack_from("@P", head)
        ptr, has_gauss, gauss = _AUG.unpack_from(head, self.aug - self.bitgen)
        if ptr != self._head.address:
            return None
        state = self._state
        bg = self.rs._bit_generator
        if state is None or state.owner is not bg or state.address != state_at:
            if type(bg) is not np.random.MT19937 or state_at != bg.ctypes.state_address:
                return None
            state = self._state = _Window(bg, state_at, _MT.size)
        return state.read(), has_gauss, gauss


@dataclass(frozen=True)
class _Readers:
    numpy: _NumpyReader | None  # None: read through np.random.get_state()
    python: _Window | None  # Python's RandomObject's index and words; None: random.getstate()


_readers: _Readers | None = None
_found = threading.Lock()


def _find_numpy(rs: Any) -> _NumpyReader | None:
    """A reader of ``rs``, its offsets found by following its pointers: its bitgen_t's first
    field is its bit generator's state address, and its aug_bitgen_t's first points back there."""
    address = rs._bit_generator.ctypes.state_address
    size = type(rs).__basicsize__
    raw = _Window(rs, id(rs), size).read()
    words = [(at, struct.unpack_from("@P", raw, at)[0]) for at in range(0, size - 7, 8)]
    bitgen = [at for at, v in words if v == address]
    if len(bitgen) != 1:
        return None
    aug = [at for at, v in words if v == id(rs) + bitgen[0] and at + _AUG.size <= size]
    return _NumpyReader(rs, bitgen[0], aug[0]) if len(aug) == 1 else None


def _numpy_agrees(reader: _NumpyReader) -> bool:
    """Whether the direct read gives exactly what ``get_state()`` gives."""
    kind, keys, pos, has_gauss, gauss = reader.rs.get_state()
    read = reader.read()
    if read is None:
        return False
    raw, fast_has, fast_gauss = read
    return (
        kind == "MT19937"
        and raw == _MT.pack(*(int(k) for k in keys), int(pos))
        and (fast_has, struct.pack("@d", fast_gauss)) == (int(has_gauss), struct.pack("@d", gauss))
    )


def _numpy_reader() -> _NumpyReader | None:
    probe = np.random.RandomState(12345)  # a private generator: the global one is not touched
    reader = _find_numpy(probe)
    if reader is None:
        return None
    for draw in (0, 1, 2, 3):  # a cached Gaussian and none, a fresh seed and a drawn position
        probe.normal(size=draw)
        probe.random_sample(draw * 7)
        if not _numpy_agrees(reader):
            return None
    probe.set_state(("MT19937", np.arange(_WORDS, dtype=np.uint32), 17, 1, -0.125))
    if not _numpy_agrees(reader):
        return None
    glob = np.random.mtrand._rand
    found = _find_numpy(glob) if type(glob) is type(probe) else None
    if found is None or (found.bitgen, found.aug) != (reader.bitgen, reader.aug):
        return None
    return found if _numpy_agrees(found) else None


def _python_agrees(r: random.Random, window: _Window) -> bool:
    version, words, _ = r.getstate()
    index, *state = _PY.unpack(window.read())
    return version == random.Random.VERSION and tuple(words) == (*state, index)


def _python_reader() -> _Window | None:
    base = random.Random.__mro__[1]  # _random.Random, the C type whose struct holds the words
    at = object.__basicsize__  # RandomObject's fields follow the object header
    if base.__basicsize__ < at + _PY.size:
        return None
    probe = random.Random(12345)  # a private generator: the global one is not touched
    window = _Window(probe, id(probe) + at, _PY.size)
    for draw in (0, 1, 700):  # a position within the words, and one past a regeneration
        for _ in range(draw):
            probe.random()
        if not _python_agrees(probe, window):
            return None
    glob = random._inst  # type: ignore[attr-defined]
    if type(glob) is not random.Random:
        return None
    window = _Window(glob, id(glob) + at, _PY.size)
    return window if _python_agrees(glob, window) else None


def _get_readers() -> _Readers:
    global _readers
    if _readers is None:
        with _found:
            if _readers is None:
                numpy: _NumpyReader | None = None
                python: _Window | None = None
                if sys.implementation.name == "cpython":
                    try:
                        numpy = _numpy_reader()
                    except Exception:  # any surprise in another NumPy: the public getter
                        numpy = None
                    try:
                        python = _python_reader()
                    except Exception:
                        python = None
                _readers = _Readers(numpy, python)
    return _readers


def reads_fast() -> tuple[bool, bool]:
    """Whether NumPy's and Python's global generators are read directly (else through the
    public getters): the layout checks passed in this process."""
    readers = _get_readers()
    return readers.numpy is not None, readers.python is not None


def numpy_state() -> tuple[str, np.ndarray, int, int, float]:
    """NumPy's global generator as ``np.random.get_state()`` gives it: the bit generator's name,
    its key words (a fresh ``uint32`` array), position, ``has_gauss`` and ``gauss``."""
    reader = _get_readers().numpy
    rs: Any = np.random.mtrand._rand
    read = None
    if reader is not None:
        # under the bit generator's lock, which NumPy's own draws take (some release the GIL)
        with rs._bit_generator.lock:
            read = reader.read()
    if read is None:
        kind, keys, pos, has_gauss, gauss = rs.get_state()
        return str(kind), keys, int(pos), int(has_gauss), float(gauss)
    raw, has_gauss, gauss = read
    keys = np.frombuffer(raw, dtype=np.uint32, count=_WORDS).copy()
    (pos,) = struct.unpack_from("@i", raw, _WORDS * 4)
    return "MT19937", keys, pos, has_gauss, gauss


def python_state() -> tuple[int, np.ndarray, float | None]:
    """Python's global generator as ``random.getstate()`` gives it, its 625 words (624 state
    words, then the position) as one ``int64`` array: (version, words, gauss_next)."""
    window = _get_readers().python
    if window is None:
        version, state, cached = random.getstate()
        return version, np.fromiter(state, dtype=np.int64, count=len(state)), cached
    raw = window.read()
    words = np.empty(_WORDS + 1, dtype=np.int64)
    words[:_WORDS] = np.frombuffer(raw, dtype=np.uint32, count=_WORDS, offset=4)
    words[_WORDS] = struct.unpack_from("@i", raw)[0]
    gauss: float | None = window.owner.gauss_next  # type: ignore[attr-defined]
    return random.Random.VERSION, words, gauss


def numpy_gauss() -> tuple[int, float]:
    """NumPy's global generator's cached Gaussian, ``(has_gauss, gauss)`` as ``get_state()``
    gives them (another bit generator than the Mersenne Twister included), without its words."""
    reader = _get_readers().numpy
    rs: Any = np.random.mtrand._rand
    if reader is not None:
        with rs._bit_generator.lock:
            read = reader.read()
        if read is not None:
            return read[1], read[2]
    state: Any = np.random.get_state(legacy=False)
    return int(state["has_gauss"]), float(state["gauss"])


# the words of Python's generator as random.getstate() last built them here, and their bytes
_py_words: tuple[bytes, tuple[int, ...]] | None = None


def python_getstate() -> tuple[int, tuple[int, ...], float | None]:
    """``random.getstate()``, for ``random.setstate()``, whose 625 Python ints are most of its
    cost (~20 µs): built again only when the words in memory changed since the last call here.
    A script that does not draw from ``random`` between two calls (a step's batch read puts it
    back, recovery/rng.py:batch_rng) gets the same words for a compare of their bytes."""
    global _py_words
    window = _get_readers().python
    if window is None:
        return random.getstate()
    raw = window.read()
    kept = _py_words
    if kept is not None and kept[0] == raw:
        gauss: float | None = window.owner.gauss_next  # type: ignore[attr-defined]
        return random.Random.VERSION, kept[1], gauss
    state = random.getstate()
    if window.read() == raw:  # no other thread drew in between: these bytes are those words
        _py_words = (raw, state[1])
    return state
