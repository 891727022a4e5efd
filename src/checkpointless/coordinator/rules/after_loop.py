"""A round open after some rank has left its training loop, as a pure rule.

Once a rank has left its loop, every rank passed the last step's collectives: there is no step
left to recover into, and the rest only need to finish (the coordinator ends the job). A rank
lost meanwhile cannot be rebuilt from peers that have left, and one that stopped for this round
(an abort that caught it in the final barrier) waits for a plan that cannot form without them:
the rule says so at once rather than at a timeout. Unit-tested in
tests/unit/coordinator/test_after_loop_rule.py.
"""

from __future__ import annotations

__all__ = ["after_the_loop"]


def after_the_loop(
    done: list[int],
    lost: list[int],
    caught: list[int],
    unfinished: list[int],
    target: int,
    waited: float,
    timeout: float,
) -> str | None:
    """Why the job cannot go on once ranks ``done`` have left the loop, or None while the rest
    may still finish: ``lost`` ranks the round is to replace, ``caught`` ranks that reported for
    it, ``unfinished`` ranks not yet done, and ``waited`` seconds since the round (generation
    ``target``) began against ``--recovery-timeout``."""
    if lost or caught:
        what = f"rank(s) {lost} were lost" if lost else f"rank(s) {caught} were interrupted"
        return (
            f"{what} after training finished (rank(s) {done} had left the loop): nothing is "
            "left to recover them with, and their work after the loop did not run"
        )
    if waited > timeout:
        return (
            f"generation {target}: ranks {unfinished} neither "
            "finished nor reported within --recovery-timeout after the others finished"
        )
    return None
