"""What an Accelerate loop's protected function prints and logs, held until its section closes.

A protected function (``accelerator.protect``, integrations/hf_accelerate.py) is a section that a
fault redoes on every rank: a line printed or a value logged by an attempt that is then redone
would be shown twice. So ``accelerator.print`` and ``accelerator.log`` inside it are held here,
as data (the printed text, the logged values), and shown once the section has closed on every
rank (``closed``, recovery/driver.py), when nothing can redo it. A tracker that raises as they
are shown is recovered in process and the showing goes on from the call that raised. They are
kept outside the process as JSON too (``encode``, recovery/held_lines.py), so the replacement of
a rank lost before it showed them shows them (``restore``).
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from checkpointless.events import get_logger

__all__ = ["Held", "HeldOutput"]

log = get_logger()


@dataclass
class Held:
    """One held call: ``accelerator.print``'s text, or ``accelerator.log``'s values."""

    kind: str  # "print" or "log"
    text: str = ""
    flush: bool = False
    file: Any = None  # print's own file (None: standard output)
    values: dict[str, Any] | None = None
    step: int | None = None
    log_kwargs: dict[str, Any] | None = None


class HeldOutput:
    """The held calls of the protected function running now (``holding``), and of the one whose
    section has closed and is being shown (``showing``). ``show_print(text, flush, file)`` and
    ``show_log(values, step, log_kwargs)`` are accelerate's own ``print`` and ``log``."""

    def __init__(
        self,
        show_print: Callable[[str, bool, Any], None],
        show_log: Callable[[dict[str, Any], int | None, dict[str, Any] | None], None],
    ) -> None:
        self._show_print = show_print
        self._show_log = show_log
        self.holding: list[Held] | None = None  # None: not inside a protected function
        self.showing: list[Held] = []

    def begin(self) -> None:
        """A protected function (or a new attempt at it) begins: an interrupted attempt's calls
        are not shown."""
        self.holding, self.showing = [], []

    def stop(self) -> None:
        """A step begins: no protected function is under way, so nothing from here is held."""
        self.holding = None

    def print(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Hold a ``print(*args, **kwargs)``, its text rendered now; False where nothing is held."""
        if self.holding is None:
            return False
        buf = io.StringIO()
        sep, end = kwargs.get("sep"), kwargs.get("end")
        print(*args, sep=sep, end=end, file=buf)
        file = kwargs.get("file")
        self.holding.append(Held("print", buf.getvalue(), bool(kwargs.get("flush")), file))
        return True

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, Any] | None) -> bool:
        """Hold a ``log`` (a copy of ``values``); False where nothing is held."""
        if self.holding is None:
            return False
        self.holding.append(Held("log", values=dict(values), step=step, log_kwargs=log_kwargs))
        return True

    def closed(self) -> None:
        """Show what the closed section held, once. Called again after a call here raised (the
        step loop recovers it), it goes on from that call: the ones before it are not repeated."""
        if self.holding is not None:  # not on the call after a raise: it goes on
            self.showing, self.holding = self.holding, None
        while self.showing:
            held = self.showing[0]
            if held.kind == "print":
                self._show_print(held.text, held.flush, held.file)
            else:
                assert held.values is not None
                self._show_log(held.values, held.step, held.log_kwargs)
            del self.showing[0]

    def encode(self) -> bytes | None:
        """What is held, as JSON, for a replacement; None when nothing is, or when a call cannot
        be kept (a print to a file of its own, values that are not JSON): shown here only."""
        held = self.holding if self.holding is not None else self.showing
        if not held:
            return None
        if any(h.file is not None for h in held):
            log.warning("held lines not kept for a replacement: a print to a file of its own")
            return None
        try:
            return json.dumps([dataclasses.asdict(h) | {"file": None} for h in held]).encode()
        except (TypeError, ValueError) as e:
            log.warning("held lines not kept for a replacement (not JSON: %s)", e)
            return None

    def restore(self, data: bytes) -> None:
        """Hold what a lost predecessor's :meth:`encode` kept, for :meth:`closed` to show."""
        self.holding, self.showing = [Held(**item) for item in json.loads(data)], []
