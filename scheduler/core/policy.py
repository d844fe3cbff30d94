"""The operator's policy: the switches the core's rules read, fixed for a scheduler's life.

One value, ``Policy``, held by the state (``State.policy``) apart from everything that
changes with events. Its defaults are the ones the scheduler ships: the command line
takes its defaults from them (scheduler/__main__.py, the one place its choices are
turned into a ``Policy``), and the host, the tests and the property drivers build it from
them too, so the core's tests check the policy that runs.

* ``affinity``: strict affinity of generating and paused runs to their replica
  (placement.py). No operator's switch: off only under the diagnostics switch
  ``LUFTPAUSE_DIAGNOSTICS=roaming-runs`` (luftpause/diagnostics.py, docs/diagnostics.md),
  to measure what it is worth;
* ``interactive_slots``: with strict affinity, keep a slot under the decode ceiling for
  each interactive run paused on a replica for the whole pause (limit.py);
* ``resume_slots``: with strict affinity, keep such a slot only while the run's tool call
  is due to return (resume.py);
* ``batch_yields``: a batch turn of a long context waits while an interactive turn is in
  flight on its accelerator (placement.py);
* ``lift``: whether the engines' decode ceilings are lifted where their throughput shows
  decoding above them pays (ceiling.py), as a ``LiftMode``.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class LiftMode(str, Enum):
    """How the decode ceiling is lifted above the engine's fast batch (ceiling.py)."""

    OFF = "off"  # the fast batch is the wall
    ON = "on"  # lifted where a larger batch buys throughput; on one replica of the pool also where it costs no more
    # ... and where it costs a token no more, even without the gain that pays an
    # interactive run's longer step: batch throughput first (ceiling.py, is_neutral).
    THROUGHPUT = "throughput"


class Policy(NamedTuple):
    """The operator's switches; ``Policy()`` is what the scheduler ships."""

    affinity: bool = True
    interactive_slots: bool = False
    resume_slots: bool = True
    lift: LiftMode = LiftMode.ON
    batch_yields: bool = True

    @property
    def keeps_slots(self) -> bool:
        """Whether a slot under the ceiling is kept for every paused interactive run: asked
        for, and affinity strict (a roaming run's next turn takes a free slot anywhere)."""
        return self.affinity and self.interactive_slots

    @property
    def resumes(self) -> bool:
        """Whether a slot under the ceiling is kept for a paused interactive run while it
        is due back: asked for, and affinity strict (resume.py)."""
        return self.affinity and self.resume_slots

    @property
    def lifts(self) -> bool:
        return self.lift is not LiftMode.OFF

    @property
    def throughput_first(self) -> bool:
        return self.lift is LiftMode.THROUGHPUT


SHIPPED = Policy()
