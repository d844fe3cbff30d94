"""A replica's health: one state, and the transitions between states the core makes.

| state | in rotation (new runs, held turns, leases) | turns of runs pinned there | learned limit | leaves it |
|---|---|---|---|---|
| ``DOWN`` | no | move elsewhere | forgotten | a healthy probe |
| ``UP`` | yes | go there | learned | any fault |
| ``UNSEEN`` | no (sight.py) | still go there | kept, grows nothing | any answered probe; a failed turn |
| ``SILENT`` | no (stalls.py) | move elsewhere | kept, grows nothing | a byte from it |
| ``STALLED`` | no (stalls.py) | move elsewhere | forgotten | an answered probe generation |

A replica starts ``DOWN`` (never probed), and only these transitions are made (a state
may also stay as it is, on any event):

| from | to | on |
|---|---|---|
| ``DOWN`` | ``UP`` | a probe that says healthy |
| ``DOWN``, ``UP``, ``UNSEEN``, ``SILENT`` | ``STALLED`` | a turn there failed *stalled* |
| ``UP`` | ``DOWN`` | a probe that says not healthy (answered: a refusal, an error status) |
| ``UP`` | ``UNSEEN`` | a probe its health route did not answer at all |
| ``UP`` | ``SILENT`` | a turn there reported silent |
| ``UNSEEN`` | ``UP``, ``DOWN`` | a probe answered: healthy, or not |
| ``UNSEEN`` | ``DOWN`` | a turn there failed, not stalled (neither path reaches it) |
| ``SILENT`` | ``UP`` | a byte from it (a first token, a finished turn), its last silent turn ended without one (cancelled, failed not stalled), or an answered probe generation with a healthy probe |
| ``SILENT``, ``STALLED`` | ``DOWN`` | an answered probe generation with a probe that says not healthy |
| ``STALLED`` | ``UP`` | an answered probe generation with a healthy probe |

Whether the engine reports its load (``Replica.load_known``) is not part of it: that is
what its metrics say, not whether turns may go there, and it is kept while the replica is
unseen or its metrics time out (limit.py).
"""

from __future__ import annotations

from enum import Enum


class Health(Enum):
    DOWN = "down"
    UP = "up"
    UNSEEN = "unseen"
    SILENT = "silent"
    STALLED = "stalled"


DOWN, UP, UNSEEN, SILENT, STALLED = Health.DOWN, Health.UP, Health.UNSEEN, Health.SILENT, Health.STALLED

# The table above: (from, to) -> the events (by class name, events.py) that may make it.
TRANSITIONS: dict[tuple[Health, Health], frozenset[str]] = {
    (DOWN, UP): frozenset({"EngineProbed"}),
    (DOWN, STALLED): frozenset({"TurnFailed"}),
    (UP, DOWN): frozenset({"EngineProbed"}),
    (UP, UNSEEN): frozenset({"EngineProbed"}),
    (UP, SILENT): frozenset({"TurnSilent"}),
    (UP, STALLED): frozenset({"TurnFailed"}),
    (UNSEEN, UP): frozenset({"EngineProbed"}),
    (UNSEEN, DOWN): frozenset({"EngineProbed", "TurnFailed"}),
    (UNSEEN, STALLED): frozenset({"TurnFailed"}),
    (SILENT, UP): frozenset({"TurnAnswered", "TurnFinished", "AdmitCancelled", "TurnFailed", "EngineProbed"}),
    (SILENT, DOWN): frozenset({"EngineProbed"}),
    (SILENT, STALLED): frozenset({"TurnFailed"}),
    (STALLED, UP): frozenset({"EngineProbed"}),
    (STALLED, DOWN): frozenset({"EngineProbed"}),
}


def legal(before: Health, after: Health, event: str) -> bool:
    """Whether the event (its class name) may take a replica from ``before`` to ``after``."""
    return before is after or event in TRANSITIONS.get((before, after), ())


def after_probe(health: Health, healthy: bool, answers: bool | None, unanswered: bool) -> Health:
    """A replica's health after a probe: ``healthy``, what its health route said;
    ``answers``, whether it answered a probe generation (None: none was sent);
    ``unanswered``, its health route did not answer at all. A stalled or silent replica
    stays so until it answers a probe generation; one in rotation or already out of sight
    whose health route does not answer is out of sight (never one already down)."""
    if health is STALLED or health is SILENT:
        if answers is not True:
            return health
    elif unanswered and (health is UP or health is UNSEEN):
        return UNSEEN
    return UP if healthy else DOWN
