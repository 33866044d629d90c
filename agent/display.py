"""Each turn of ``coda-agent solve`` as it happens.

The loop reports :class:`~.loop.TurnEvent` s; :class:`TurnDisplay` is the
callback that shows them.  Every judged turn becomes one line: the turn, the
verdict and the stage it reached, the tokens spent so far::

    turn 1: rejected at reference: `y` differs from the reference on shape set small ... (150 tokens)
    turn 2: cpu_passed: passed static, reference, compile; GPU stages skipped (300 tokens)

(``sample N turn M:`` with several samples).  On a terminal a live status line
per sample sits below them (rich: what each sample is doing now, asking the
model or being judged); elsewhere (a log, CI, a pipe) the lines are all there
is, printed as they happen.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coda_agent.verifier.report import Report

    from .loop import TurnEvent

MESSAGE_CHARS = 160  # of a failing stage's message on its turn line; the report has the rest


def verdict(report: "Report") -> str:
    """The outcome and the stage it reached (or was slow at), in one line."""
    bad = next((s for s in report.stages if s.status in ("failed", "error", "slow")), None)
    if bad is not None:
        first = (bad.message.strip().splitlines() or [""])[0]
        if len(first) > MESSAGE_CHARS:
            first = first[:MESSAGE_CHARS - 3] + "..."
        return f"{report.outcome} at {bad.name}: {first}"
    passed = [s.name for s in report.stages if s.status == "passed"]
    skipped = [s.name for s in report.stages if s.status == "skipped"]
    text = f"{report.outcome}: passed {', '.join(passed) or 'nothing'}"
    return text + ("; GPU stages skipped" if skipped else "")


class TurnDisplay:
    """The ``on_event`` callback of a run's trajectories (thread-safe: samples run on threads)."""

    def __init__(self, samples: int, console=None):
        from rich.console import Console

        self.samples = samples
        self.console = console or Console(highlight=False, soft_wrap=True)
        self._lock = threading.Lock()
        self._live = None
        self._rows: dict[int, int] = {}

    def __enter__(self) -> "TurnDisplay":
        if self.console.is_terminal:
            from rich.progress import Progress, SpinnerColumn, TextColumn

            self._live = Progress(SpinnerColumn(), TextColumn("{task.description}"), console=self.console,
                                  transient=True)
            self._rows = {i: self._live.add_task(self._who(i) + "starting") for i in range(self.samples)}
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()

    def _who(self, sample: int) -> str:
        return f"sample {sample} " if self.samples > 1 else ""

    def __call__(self, event: "TurnEvent") -> None:
        with self._lock:
            who, tokens = self._who(event.sample), f"({event.tokens} tokens)"
            if event.kind == "judged" and event.report is not None:
                self.console.print(f"{who}turn {event.turn}: {verdict(event.report)} {tokens}", markup=False)
            elif event.kind == "format_error":
                self.console.print(f"{who}turn {event.turn}: no program in the reply: {event.detail} {tokens}",
                                   markup=False)
            if self._live is not None:
                now = {"asking": f"turn {event.turn + 1}: asking the model",
                       "judging": f"turn {event.turn}: verifying", "stopped": f"stopped: {event.detail}"}
                if event.kind in now:
                    self._live.update(self._rows[event.sample], description=f"{who}{now[event.kind]} {tokens}",
                                      refresh=True)
