"""Reading the global generators from their memory (state/rng_read.py): the reads give exactly
what the public getters give (the cached Gaussians included), a capture restores to the
identical streams, the compares that skip a record's write see a draw that only took a cached
Gaussian, and a script that gives NumPy another generator is still read right."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from checkpointless.recovery.rng_compare import same_rng, unchanged
from checkpointless.state.rng_read import numpy_gauss, numpy_state, python_getstate, python_state, reads_fast
from checkpointless.state.snapshot import capture_rng, restore_rng

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _global_generators() -> Iterator[None]:
    """Each test leaves the global generators as it found them."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    torch_state = torch.get_rng_state()
    yield
    np.random.set_state(np_state)
    random.setstate(py_state)
    torch.set_rng_state(torch_state)


def _numpy_matches() -> None:
    state: Any = np.random.get_state()  # the legacy tuple (typed as a tuple or a dict)
    kind, keys, pos, has_gauss, gauss = state
    got = numpy_state()
    assert got[0] == kind
    assert got[1].dtype == np.uint32 and np.array_equal(got[1], keys)
    assert got[2:] == (pos, has_gauss, gauss)
    assert np.float64(got[4]).tobytes() == np.float64(gauss).tobytes()


def _legacy() -> Any:
    return np.random.get_state()


def _python_matches() -> None:
    version, words, gauss = random.getstate()
    got = python_state()
    assert got[0] == version
    assert tuple(got[1].tolist()) == words
    assert got[2] == gauss


def test_reads_fast_here() -> None:
    # this project's CPython and NumPy: the direct reads pass their checks (else the step pays
    # the public getters' ~0.2 ms again, benchmarks/rank_rng.py)
    assert reads_fast() == (True, True)


def test_numpy_read_equals_get_state() -> None:
    np.random.seed(7)
    _numpy_matches()  # a fresh seed: position 624, no cached Gaussian
    np.random.normal()
    _numpy_matches()  # a cached Gaussian
    np.random.normal()
    _numpy_matches()  # it was taken, the key words untouched
    np.random.random_sample(1000)
    _numpy_matches()  # past a regeneration of the key words
    np.random.set_state(("MT19937", np.arange(624, dtype=np.uint32), 5, 1, -0.0))
    _numpy_matches()  # a state set by a script, its cached Gaussian -0.0


def test_python_read_equals_getstate() -> None:
    random.seed(7)
    _python_matches()
    random.gauss(0, 1)
    _python_matches()  # gauss_next cached
    for _ in range(700):
        random.random()
    _python_matches()  # past a regeneration
    random.gauss(0, 1)
    _python_matches()  # gauss_next taken


def _draws() -> tuple[float, list[float], float, float, list[float]]:
    # NumPy's first normal() after the capture returns the cached Gaussian, not a fresh pair
    return (
        float(np.random.normal()),
        np.random.normal(size=3).tolist(),
        random.gauss(0, 1),
        random.random(),
        torch.rand(4).tolist(),
    )


def test_capture_restores_identical_streams_with_cached_gaussians() -> None:
    np.random.seed(11)
    random.seed(12)
    torch.manual_seed(13)
    np.random.normal()  # leaves a cached Gaussian in NumPy's generator
    random.gauss(0, 1)  # and in Python's
    assert _legacy()[3] == 1
    rng = capture_rng()
    first = _draws()
    restore_rng(rng)
    assert _draws() == first
    restore_rng(rng)
    assert same_rng(capture_rng(), rng) and unchanged(rng)


def test_compares_see_a_draw_that_took_only_a_cached_gaussian() -> None:
    np.random.seed(3)
    np.random.normal()
    rng = capture_rng()
    assert unchanged(rng)
    np.random.normal()  # takes the cached value: NumPy's key words and position do not move
    assert np.array_equal(_legacy()[1], rng["numpy"][1])
    assert not unchanged(rng)
    assert not same_rng(capture_rng(), rng)

    random.seed(4)
    random.gauss(0, 1)
    rng = capture_rng()
    random.gauss(0, 1)  # Python's gauss_next taken, its words untouched
    assert not unchanged(rng)
    assert not same_rng(capture_rng(), rng)


def test_numpy_given_another_generator_is_read_right() -> None:
    npr: Any = np.random  # its stubs do not export these two
    own = npr.get_bit_generator()
    try:
        npr.set_bit_generator(np.random.MT19937(99))
        np.random.normal()
        _numpy_matches()  # the new generator's state, not the one the reader first found
        rng = capture_rng()
        first = _draws()
        restore_rng(rng)
        assert _draws() == first
    finally:
        npr.set_bit_generator(own)
    _numpy_matches()


def test_python_getstate_and_numpy_gauss_are_the_getters_values() -> None:
    """python_getstate reuses the words it last built while they stand: after draws, a seed, a
    setstate and a cached Gaussian it must still give exactly random.getstate()."""
    random.seed(3)
    for change in (lambda: None, random.random, lambda: random.seed(4), random.gauss, lambda: None):
        change()
        assert python_getstate() == random.getstate()
    kept = random.getstate()
    random.random()
    random.setstate(kept)
    assert python_getstate() == kept
    for draw in (0, 1, 2):
        np.random.normal(size=draw)
        state: Any = np.random.get_state()
        assert numpy_gauss() == (state[3], state[4])
