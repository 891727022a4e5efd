"""Conditions that last: said once when they begin and once when they end, never per tick.

The coordinator's loop turns every 20-100 ms; a state such as "no spare host is left" or "rank 3
waits for a spare" holds over thousands of turns. :class:`Conditions` remembers which are on and
returns a :class:`Change` only when one flips, so the caller logs and emits exactly twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Change", "Conditions"]


@dataclass(frozen=True)
class Change:
    name: str
    active: bool  # True: it began; False: it ended
    detail: str


@dataclass
class Conditions:
    active: dict[str, str] = field(default_factory=dict)  # name -> the detail it began with

    def update(self, name: str, on: bool, detail: str = "") -> Change | None:
        """Record whether ``name`` holds now; a :class:`Change` when that differs from before."""
        if on and name not in self.active:
            self.active[name] = detail
            return Change(name, True, detail)
        if not on and name in self.active:
            began = self.active.pop(name)
            return Change(name, False, detail or began)
        return None
