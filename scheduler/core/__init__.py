"""The scheduler's decision core: the admission policy as pure functions.

``decide(state, event) -> (state, actions)`` takes immutable state and one event and
returns the next state and what the host must do. No I/O, no clock reads: time comes
in the events. Each file is one chapter of the policy, its rule at the top:

* ``policy.py``: the operator's switches (``Policy``), defaulting to the shipped ones;
* ``health.py``: a replica's health, one state, and the transitions the core makes;
* ``state.py``: the state types, and the speed trick that keeps them cheap to change;
* ``events.py``: the events the host reports and the actions it performs;
* ``decide.py``: dispatch, the one entry point; checks on an Admit; expiry;
* ``placement.py``: where a turn goes (affinity, release order, spreading) and when;
* ``ceiling.py``: the decode ceiling lifted where the engine decodes above it cheaply;
* ``limit.py``: the admission limit, the decode ceiling and the batch reserve;
* ``leases.py``: slots lent to dataplanes while nothing is held;
* ``peers.py``: dataplanes as peers, each owning what it admitted; Resync;
* ``stalls.py``: stalled replicas leave rotation until they answer, silent ones until they speak;
* ``stranded.py``: turns held with no replica of their model in rotation are answered within a bound;
* ``status.py``: the plain-value view for the status endpoints and the page.

Chapters import the state and the events and the chapters before them (policy, health,
state, events, ceiling, limit, placement, peers, leases, stalls, stranded, status, decide):
never a later one.
"""

from luftpause.vocabulary import BATCH, INTERACTIVE, SERVICE_CLASSES
from luftpause.scheduler.core.decide import decide, validation_error
from luftpause.scheduler.core.events import (
    Action,
    AdmitCancelled,
    AdmitRequested,
    ClockTicked,
    DataplaneGone,
    EngineProbed,
    Event,
    Grant,
    LeaseReturned,
    LeaseTaking,
    Place,
    Reject,
    Resynced,
    Revoke,
    RunEnded,
    RunSnapshot,
    TurnAnswered,
    TurnFailed,
    TurnFinished,
    TurnSilent,
    TurnSnapshot,
    TurnUsage,
)
from luftpause.scheduler.core.health import Health
from luftpause.scheduler.core.limit import batch_reserve
from luftpause.scheduler.core.policy import LiftMode, Policy
from luftpause.scheduler.core.state import (
    GENERATIVE,
    ONE_PASS,
    TURN_TIME_WEIGHT,
    AdmissionLimit,
    DecodeCost,
    DecodeCounters,
    HeldTurn,
    Lease,
    Replica,
    Run,
    Stage,
    State,
    Turn,
    initial_state,
)
from luftpause.scheduler.core.status import run_page, status

__all__ = [
    "BATCH", "GENERATIVE", "INTERACTIVE", "ONE_PASS", "SERVICE_CLASSES", "TURN_TIME_WEIGHT",
    "Action", "AdmissionLimit", "AdmitCancelled", "AdmitRequested", "ClockTicked", "DataplaneGone", "DecodeCost", "DecodeCounters", "EngineProbed", "Event", "Grant",
    "Health", "HeldTurn", "Lease", "LeaseReturned", "LeaseTaking", "LiftMode", "Place", "Policy", "Reject", "Replica",
    "Resynced", "Revoke", "Run", "RunEnded", "RunSnapshot", "Stage", "State", "Turn", "TurnAnswered", "TurnFailed",
    "TurnFinished", "TurnSilent", "TurnSnapshot", "TurnUsage",
    "batch_reserve", "decide", "initial_state", "run_page", "status", "validation_error",
]
