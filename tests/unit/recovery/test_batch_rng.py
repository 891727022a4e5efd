"""``batch_rng`` (recovery/rng.py) puts the global generators aside cheaply, by lending NumPy a
bit generator of its own and reusing Python's words when nothing drew: the draws inside it and
the generators after it must be exactly those of the public getters, seeders and setters it
replaced, cached Gaussians, nesting and another NumPy bit generator included."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from checkpointless.recovery.rng import batch_rng, stream_seed

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def public_batch_rng(step: int) -> Iterator[None]:
    """What batch_rng did through the public API: the behaviour it must keep."""
    seed = stream_seed(0, "batch", 0, step)
    cpu, py, npy = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(py)
        np.random.set_state(npy)


@pytest.fixture(autouse=True)
def _global_generators() -> Iterator[None]:
    """Each test leaves the global generators as it found them."""
    bits = np.random.get_bit_generator()
    np_state, py_state, torch_state = np.random.get_state(), random.getstate(), torch.get_rng_state()
    yield
    np.random.set_bit_generator(bits)
    np.random.set_state(np_state)
    random.setstate(py_state)
    torch.set_rng_state(torch_state)


def draws() -> list[Any]:
    # a Gaussian from each, so a cached second half of a pair is taken or left behind
    return [
        torch.rand(3).tolist(),
        random.random(),
        random.gauss(),
        np.random.random(2).tolist(),
        np.random.normal(),
    ]


def states() -> list[Any]:
    np_state: Any = np.random.get_state(legacy=False)
    keys = np_state["state"]
    return [
        torch.get_rng_state().tolist(),
        random.getstate(),
        [np_state["bit_generator"], {k: np.asarray(v).tolist() for k, v in keys.items()}],
        [np_state["has_gauss"], np_state["gauss"]],
    ]


def run(reader: Callable[[int], Any], nested: bool) -> list[Any]:
    """Draws inside a batch read (and one read inside it), the generators after, and draws after."""
    seen: list[Any] = []
    for step in (3, 4):
        with reader(step):
            seen.append(draws())
            if nested:
                with reader(step + 10):
                    seen.append(draws())
                seen.append(draws())
        seen.append(states())
        seen.append(draws())
    return seen


def seeded() -> None:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)


def np_gauss_cached() -> None:
    seeded()
    np.random.normal()  # the pair's second half is kept: has_gauss=1


def py_gauss_cached() -> None:
    seeded()
    random.gauss()  # gauss_next is set


def np_stale_gauss() -> None:
    seeded()
    state: Any = np.random.get_state()
    np.random.set_state((state[0], state[1], state[2], 0, 0.25))  # no Gaussian, a value kept


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("prepare", [seeded, np_gauss_cached, py_gauss_cached, np_stale_gauss])
def test_draws_inside_and_generators_after_are_the_public_apis(
    prepare: Callable[[], None], nested: bool
) -> None:
    prepare()
    want = run(public_batch_rng, nested)
    prepare()
    assert run(batch_rng, nested) == want


def test_the_rank_keeps_its_own_numpy_bit_generator_and_its_words() -> None:
    seeded()
    own = np.random.get_bit_generator()
    before = states()
    with batch_rng(5):
        assert np.random.get_bit_generator() is not own
        np.random.random(1000)
    assert np.random.get_bit_generator() is own and states() == before


def test_another_numpy_bit_generator_is_lent_aside_and_given_back() -> None:
    """A script gave NumPy's global generator a PCG64 (the public getters could not seed it):
    the read still draws the step's legacy-seeded stream, and the PCG64 goes on as it stood."""
    seeded()
    with public_batch_rng(5):
        want_inside = draws()
    pcg = np.random.PCG64(11)
    np.random.set_bit_generator(pcg)
    np.random.normal()  # a cached Gaussian on top
    before = states()
    with batch_rng(5):
        inside = draws()
    assert np.random.get_bit_generator() is pcg and states() == before
    assert inside == want_inside
