"""Degraded mode's held pass (recovery/held_pass.py): the slot ``job.rank`` gives in a held pass,
and the report of a held pass that got the rank's own inputs again."""

from __future__ import annotations

import pytest
import torch

from checkpointless.recovery.held_pass import HeldPass, inputs_digest

pytestmark = pytest.mark.timeout(10)

X = torch.arange(12, dtype=torch.float32).reshape(3, 4)
Y = torch.arange(12, 24, dtype=torch.float32).reshape(3, 4)


def _step(
    hp: HeldPass, index: int, own_inputs: object, held_inputs: object, served: bool = False
) -> str | None:
    """One degraded step of two passes (own, then slot 2's); what the held pass reports."""
    hp.begin(index, None, 0, 2)
    assert hp.slot is None and hp.on_forward(own_inputs) is None
    hp.on_forward(Y)  # a second forward in the pass is not compared
    hp.end()
    hp.begin(index, 2, 1, 2)
    assert hp.slot == 2
    if served:
        assert hp.data_slot(2) == 2
    got = hp.on_forward(held_inputs)
    hp.end()
    assert hp.slot is None
    return got


def test_full_width_compares_nothing() -> None:
    hp = HeldPass()
    hp.begin(0, None, 0, 1)
    assert hp.on_forward(((X,), {})) is None and hp.on_forward(((X,), {})) is None


def test_the_held_pass_given_the_own_inputs_is_reported_once_per_slot() -> None:
    hp = HeldPass()
    assert _step(hp, 0, ((X,), {}), ((Y,), {})) is None  # the slot's own batch: nothing to say
    detail = _step(hp, 1, ((X,), {}), ((X.clone(),), {}))
    assert detail is not None and "held slot 2 at step 1" in detail and "job.rank" in detail
    assert _step(hp, 2, ((X,), {}), ((X,), {})) is None  # said once


def test_a_held_pass_a_job_loader_served_is_trusted() -> None:
    # every rank reading the same batches through job.loader (a SequentialSampler) is exact
    assert _step(HeldPass(), 0, ((X,), {}), ((X,), {}), served=True) is None
    assert HeldPass().data_slot(None) is None


def test_forwards_without_tensors_are_not_compared() -> None:
    assert _step(HeldPass(), 0, ((), {"n": 3}), ((), {"n": 3})) is None


def test_the_digest_sees_values_shapes_dtypes_and_keyword_order_not() -> None:
    base = inputs_digest(((), {"input_ids": X, "labels": Y}))
    assert base == inputs_digest(((), {"labels": Y, "input_ids": X}))
    assert base != inputs_digest(((), {"input_ids": Y, "labels": X}))
    assert inputs_digest((X,)) != inputs_digest((X.reshape(4, 3),))
    assert inputs_digest((X,)) != inputs_digest((X.double(),))
    assert inputs_digest((torch.tensor(1.5), torch.ones(2, dtype=torch.bfloat16))) is not None
    assert inputs_digest(((), {})) is None
