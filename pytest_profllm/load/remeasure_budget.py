"""How long a session may spend measuring again (`--profllm-remeasure`): no longer than it
spent on the first runs of its loads. A host that stays busy makes every attempt invalid, and
without a bound each load would cost 1 + remeasure runs; with it, re-measuring at most doubles
a session's measuring time, however many loads or attempts it has. A run already started
runs to its end; the next one is not started.

The bound is the session's own first runs rather than a fixed time, so that it scales with
the suite (a smoke suite and a day's sweep alike) and needs no option; with a floor of
`MIN_AGAIN_S`, so that a short suite (loads of a second or two: real vLLM's 2 x 2 took 2 s of
first runs) may still run a late load again more than once.
"""

from __future__ import annotations

from dataclasses import dataclass

# Runs again may always take this long, however short the first runs were.
MIN_AGAIN_S = 60.0


@dataclass
class RemeasureBudget:
    first_s: float = 0.0  # seconds of the session's first run of each load
    again_s: float = 0.0  # seconds of its runs again

    def spent(self, seconds: float, *, again: bool) -> None:
        """Count one run's seconds: a first run, or a run again."""
        if again:
            self.again_s += max(seconds, 0.0)
        else:
            self.first_s += max(seconds, 0.0)

    def allows(self) -> bool:
        """Whether another run again may start: the runs again so far took less than the
        first runs (or than `MIN_AGAIN_S`)."""
        return self.again_s < max(self.first_s, MIN_AGAIN_S)

    def exhausted_reason(self) -> str:
        if self.first_s < MIN_AGAIN_S:
            return (f"re-measuring stopped: this session's runs again took "
                    f"{self.again_s:.0f} s, its floor of {MIN_AGAIN_S:.0f} s")
        return (f"re-measuring stopped: this session's runs again took {self.again_s:.0f} s, "
                f"as long as its first runs ({self.first_s:.0f} s)")
