"""Placement and affinity: which held turn goes where, and when.

* a turn goes only to a healthy generative replica serving its model;
* a turn that names the replicas it may go to (an inference gateway's endpoint subset)
  goes only to one of them; a run pinned outside them moves within them, as from a
  replica that is gone (the gateway said not to send it there);
* a run that is generating or paused on a tool goes only to its last replica while
  that replica is healthy, or only out of the scheduler's sight (strict affinity;
  sight.py), and its recent turn time is under
  AFFINITY_SLOWER_FACTOR times a faster peer's (on another device: replicas sharing
  one take turns at it and are as quick as each other): past that the run's turn goes
  to the fastest of those peers with room (its prefix prefilled again there: a price
  of about one turn there, against a turn that would take several times as long at
  home), and home only while none has room. An engine ten times slower keeps only the
  first turns of the runs it is given;
* a turn goes only where there is room (limit.py); held turns are released interactive
  first, then the caller with the fewest running turns, then turns of runs already
  under way before the first turns of new ones (a run's prefix is cached only while it
  runs: finishing started runs keeps the engines' caches on fewer, warmer runs), then
  in arrival order;
* a turn free to go anywhere goes where the turns in flight would end soonest at each
  replica's recent turn time (fewest in flight while any has none finished): an engine
  ten times slower than its peer takes about a tenth of new runs; replicas sharing one
  device are filled one at a time, but an interactive turn goes to the one with the
  fewest interactive runs under way, then their fewest context tokens (each replica
  has its own KV pool), and a new interactive run waits for such a replica while it
  has no room;
* a batch turn whose run's context is at least an eighth of the replica's KV pool waits,
  for at most two seconds, while an interactive turn is in flight on its accelerator:
  its long prefill would hold that turn's tokens step after step;
* but a replica much slower than a peer whose capacity is known (a learned limit or a
  ceiling) takes no turn that peer could take while fewer turns are held than the
  peer finishes in one of the slow replica's turns (the room the turn's class has
  there times the ratio of turn times, less one turn): waiting for a slot there ends
  sooner than a turn on the slow one. A closed loop of agents would otherwise leave runs crawling there while
  the quick one frees a slot every few tens of milliseconds;
* after a (re)start nothing is placed until every replica's first probe is in (or
  the first round timed out), so no turn lands on the replica probed first.

Here too the bookkeeping of runs and placed turns, which keeps each replica's turns in
flight and its paused-run reserve in step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from immutables import Map

from luftpause.scheduler.constants import AFFINITY_SLOWER_FACTOR, YIELD_CONTEXT_DIVISOR, YIELD_WAIT_MAX_MS
from luftpause.scheduler.core.events import Action, AdmitCancelled, Place, TurnUsage
from luftpause.scheduler.core.health import UNSEEN, UP
from luftpause.scheduler.core.limit import _batch_capacity, _has_room, _keeps_slots, _kv_fits
from luftpause.scheduler.core.resume import due_now, expected_pause_ms, with_resume
from luftpause.scheduler.core.state import (
    GENERATIVE,
    TURN_TIME_WEIGHT,
    HeldTurn,
    _much_faster,
    Replica,
    Run,
    Stage,
    State,
    Turn,
)
from luftpause.vocabulary import BATCH, INTERACTIVE


def _pin(state: State, run: Run | None) -> str:
    """The replica a run's turns must go to while it is healthy, or "" (strict affinity)."""
    if state.policy.affinity and run is not None and run.stage is not Stage.IDLE and run.replica:
        return run.replica
    return ""


def _candidates(state: State, turn: HeldTurn) -> list[Replica]:
    """Replicas this turn may go to, before looking at their load: a pinned run's own
    replica (while healthy, or only out of the scheduler's sight: sight.py), last, after
    the peers much faster than it (see :func:`_much_faster`)."""
    allowed = turn.allowed
    serving = [r for r in state.replicas.values() if r.kind == GENERATIVE and r.health is UP and turn.model in r.models
               and (not allowed or r.name in allowed)]  # r.healthy, spelt out in the release loop's hot path
    pin = _pin(state, state.runs.get(turn.run_id))
    if pin and (not allowed or pin in allowed):  # pinned outside the allowed ones: it moves within them
        r = state.replicas.get(pin)
        if r is not None and r.kind == GENERATIVE and r.holds_pins and turn.model in r.models:
            # strict affinity while the run's replica is healthy (or out of sight only) and not much slower than a peer
            return [p for p in serving if _much_faster(p, r)] + [r]
    return serving


def _slower_than_a_peer(state: State, replica: Replica) -> bool:
    """Whether a healthy generative peer serving one of its models is much faster
    (:func:`_much_faster`): runs pinned here may leave, and no slot here is lent."""
    return any(r.kind == GENERATIVE and r.healthy and r.models & replica.models and _much_faster(r, replica)
               for r in state.replicas.values())


def _slow_replicas(state: State) -> frozenset[str]:
    """The generative replicas :func:`_slower_than_a_peer`, found in one pass when none is
    (the usual case: no recent time per token or per turn is AFFINITY_SLOWER_FACTOR times
    the quickest healthy one's), as the release loop asks for every held turn it places."""
    # (r.healthy, spelt out in the release loop's hot path)
    turn = token = 0  # the quickest times, per turn and per token
    for r in state.replicas.values():
        if r.kind == GENERATIVE and r.health is UP and r.turn_ms:
            turn = min(turn or r.turn_ms, r.turn_ms)
            if r.token_us:
                token = min(token or r.token_us, r.token_us)
    if not turn:
        return frozenset()
    turn, token = turn * AFFINITY_SLOWER_FACTOR, token * AFFINITY_SLOWER_FACTOR
    return frozenset(r.name for r in state.replicas.values()
                     if r.kind == GENERATIVE and r.turn_ms
                     and (turn <= r.turn_ms or (token and r.token_us and token <= r.token_us))
                     and _slower_than_a_peer(state, r))


def _closed_to_free_turns(state: State) -> dict[str, frozenset[str]]:
    """Per class, the replicas much slower than a peer of known capacity that take no
    turn of that class such a peer could take: while the turns held are fewer than those
    peers finish in one of the slow replica's turns (in the room the class has there:
    batch turns leave the room kept for paused interactive runs), a held turn gets a
    slot there sooner than the slow turn would end."""
    if not state.held:
        return {}
    keep = _keeps_slots(state)
    closed: dict[str, set[str]] = {INTERACTIVE: set(), BATCH: set()}
    for name in _slow_replicas(state):
        slow = state.replicas[name]
        if not slow.healthy:
            continue
        meanwhile = {INTERACTIVE: 0.0, BATCH: 0.0}
        for fast in state.replicas.values():
            if fast.kind == GENERATIVE and fast.healthy and fast.models & slow.models and _much_faster(fast, slow):
                if fast.capacity is None:  # its room is not known: in flight decides (_best_replica)
                    continue
                turns_meanwhile = slow.turn_ms / fast.turn_ms - 1
                meanwhile[INTERACTIVE] += fast.capacity * turns_meanwhile
                meanwhile[BATCH] += max(0, _batch_capacity(fast, keep) or 0) * turns_meanwhile
        for service_class, finished in meanwhile.items():
            if len(state.held) < finished:
                closed[service_class].add(slow.name)
    return {service_class: frozenset(names) for service_class, names in closed.items() if names}


def _awaiting_first_probes(state: State, now_ms: int) -> bool:
    """Whether a (re)started scheduler still waits for replicas' first probes: nothing is
    placed (or lent) until they are in or the wait is over."""
    return bool(state.unprobed) and now_ms < state.unprobed_until_ms


def _first_probe_in(state: State, replica: str) -> State:
    if replica in state.unprobed:
        return state._replace(unprobed=state.unprobed - {replica})
    return state


def _release_held(state: State, now_ms: int) -> tuple[State, list[Action]]:
    """Place held turns, best first, while any fits."""
    actions: list[Action] = []
    if _awaiting_first_probes(state, now_ms):
        return state, actions  # the pool is not known yet
    state = due_now(state, now_ms)
    while state.held:
        homes = _homes_with_room(state)
        if homes is None:
            break
        chosen = _next_placement(state, homes, now_ms)
        if chosen is None:
            break
        turn, replica = chosen
        state = _place(state, turn, replica, now_ms)
        actions.append(Place(turn.turn_id, replica.name, max(0, now_ms - turn.arrived_ms)))
    return state, actions


def _homes_with_room(state: State) -> dict[str, list[str]] | None:
    """Per class, the homes whose held turns could be placed now: free turns, turns
    pinned to a replica with room for that class (healthy or out of sight), and turns
    pinned to an unhealthy replica or to one much slower than a peer with room (they
    may move). None when no replica has room at all."""
    interactive: list[str] = [""]
    batch: list[str] = [""]
    slow: list[str] = []
    keep = _keeps_slots(state)
    slower = _slow_replicas(state)
    for name, r in state.replicas.items():
        if r.kind != GENERATIVE:
            continue
        if r.health is not UP and r.health is not UNSEEN:  # not r.holds_pins, spelt out in the hot path
            interactive.append(name)
            batch.append(name)
            continue
        if _has_room(r, INTERACTIVE, keep):
            interactive.append(name)
            if _has_room(r, BATCH, keep):
                batch.append(name)
        if name in slower:
            slow.append(name)
    if len(interactive) == 1:
        return None
    for homes in (interactive, batch):
        if len(homes) > 1:  # some replica has room for the class: the slow one's runs may go there
            homes.extend(name for name in slow if name not in homes)
    return {INTERACTIVE: interactive, BATCH: batch}


def _next_placement(state: State, homes: dict[str, list[str]], now_ms: int) -> tuple[HeldTurn, Replica] | None:
    """The best-ranked held turn that fits somewhere now. A turn that does not fit keeps
    every lower-ranked turn off the replicas it is waiting for."""
    open_replicas = {name for name in homes[INTERACTIVE]
                     if name and state.replicas[name].health in (UP, UNSEEN)}  # holds_pins, spelt out in the hot path
    blocked: set[str] = set()
    keep = _keeps_slots(state)
    closed = _closed_to_free_turns(state)
    yielding = _serving_interactive(state) if state.policy.batch_yields else frozenset()
    for turn in _held_in_release_order(state, homes):
        candidates = _candidates(state, turn)
        shut = closed.get(turn.service_class)
        if shut:  # a much faster peer frees a slot before a turn on the slow one ends
            candidates = [r for r in candidates if r.name not in shut] or candidates
        roomy = [r for r in candidates if r.name not in blocked and _has_room(r, turn.service_class, keep, turn.opens)]
        if roomy and turn.service_class == BATCH:
            run = state.runs.get(turn.run_id)
            if run is not None and run.context_tokens:
                tokens = run.context_tokens
                yields_to = yielding if now_ms - turn.arrived_ms < YIELD_WAIT_MAX_MS else frozenset()
                roomy = [r for r in roomy if _kv_fits(r, tokens) and not _yields(r, tokens, yields_to)]
        fewer = _fewer_agents_full(state, candidates, roomy) if roomy and turn.opens \
            and turn.service_class == INTERACTIVE else []
        if fewer:  # it waits for the pool with fewer agents; turns behind it may still go elsewhere
            blocked.update(fewer)
            if open_replicas <= blocked:
                return None
            continue
        if roomy:
            if turn.home and len(roomy) > 1:  # a pinned run leaving a much slower replica: not back there
                roomy = [r for r in roomy if r.name != turn.home]
            return turn, _best_replica(state, roomy, turn.service_class == INTERACTIVE)
        blocked.update(r.name for r in candidates)
        if open_replicas <= blocked:
            return None
    return None


def _serving_interactive(state: State) -> frozenset[str]:
    """The accelerators (a replica's device, or its name) with an interactive turn in flight."""
    return frozenset(r.device or r.name for r in state.replicas.values() if r.interactive_in_flight)


def _yields(replica: Replica, tokens: int, yielding: frozenset[str]) -> bool:
    """Whether a batch turn of a run whose context is ``tokens`` waits on ``replica``: an
    interactive turn is in flight on its accelerator (``yielding``) and the context is at
    least 1/YIELD_CONTEXT_DIVISOR of the replica's KV pool. Contexts that size outgrow the
    pool with a few agents, so most of one is computed again when its turn comes, and the
    engine prefills it in chunks ahead of the interactive turn's next tokens, step after
    step. The caller stops asking once the turn has waited YIELD_WAIT_MAX_MS: interactive
    turns one after another do not shut it out (docs/admission.md, "Interactive turns
    before long batch prefills")."""
    return (bool(yielding) and bool(replica.kv_total) and (replica.device or replica.name) in yielding
            and tokens * YIELD_CONTEXT_DIVISOR >= replica.kv_total)


def _fewer_agents_full(state: State, candidates: list[Replica], roomy: list[Replica]) -> list[str]:
    """The healthy replicas without room that share a device with one that has room and
    hold fewer interactive runs than every roomy replica there: a new interactive run
    waits for one of them rather than join a pool with more agents."""
    least: dict[str, int] = {}
    for r in roomy:
        if r.device:
            least[r.device] = min(least.get(r.device, r.interactive_runs), r.interactive_runs)
    names = {r.name for r in roomy}
    return [r.name for r in candidates if r.device in least and r.name not in names and r.healthy
            and r.interactive_runs < least[r.device]]


def _held_in_release_order(state: State, homes: dict[str, list[str]]) -> Iterator[HeldTurn]:
    """Held turns filed under ``homes[class]``: interactive first, then the caller with
    the fewest running turns, then runs under way before new ones, then arrival (a
    k-way merge of the FIFOs filed per caller and per kind: opening or continuing).

    Why runs under way first: an engine keeps a run's prefix cached only while it is
    recent. Starting new runs while started ones wait spreads the cache over more runs,
    and a waiting run's prefix is evicted and prefilled again when its turn comes.
    Fairness between callers still comes first: a new run of a caller with fewer turns
    running goes before another caller's runs under way. And a new run is not starved:
    it waits only for turns of runs already under way, and no later new run of its
    caller goes ahead of it, so the runs it waits for can only end."""
    held = state.held
    for service_class in (INTERACTIVE, BATCH):
        heads = []
        for home in homes[service_class]:
            by_class = state.held_queues.get(home)
            by_caller = by_class.get(service_class) if by_class is not None else None
            if not by_caller:
                continue
            for (caller, opens), turn_ids in by_caller.items():
                heads.append((state.running_by_caller.get(caller, 0), opens, held[turn_ids[0]].seq, turn_ids, 0))
        heapq.heapify(heads)
        while heads:
            running, opens, _, turn_ids, index = heads[0]
            yield held[turn_ids[index]]
            if index + 1 < len(turn_ids):
                heapq.heapreplace(heads, (running, opens, held[turn_ids[index + 1]].seq, turn_ids, index + 1))
            else:
                heapq.heappop(heads)


def _best_replica(state: State, roomy: list[Replica], interactive: bool = False) -> Replica:
    """Spread across devices, fill within one: the device with the fewest turns in
    flight (on replicas of their own, once each has finished turns: the one whose turns
    in flight would end soonest at its recent turn time), and on a device several
    replicas share, the busiest of them that has room.
    Replicas on one accelerator take turns at it, each pass reading all the weights, so
    one replica with the whole batch decodes faster than two with half each; the next
    one there takes turns once the first is at its limit.
    But an interactive turn on a shared device goes to the replica with the fewest
    interactive runs under way, then the fewest context tokens held by them, busiest
    first among equals. Each replica has a KV pool of its own, and an interactive run
    keeps its replica for its whole life: filled one replica at a time, the long-lived
    agents' contexts would share one pool and push each other out during their tool
    pauses while the other pool held batch KV. Runs are counted before their tokens: a
    context grows through its run, so a large one is near its end and a new one will
    grow; balanced by today's sizes alone, new runs joined the pool whose agents were
    about to finish, three or four agents to one pool."""
    if len(roomy) == 1:
        return roomy[0]
    if not any(r.device for r in roomy):
        if all(r.turn_ms for r in roomy):
            # Where the turns it has would end soonest: a replica whose turns take ten
            # times as long takes about a tenth of them (equal ones alternate as before).
            return min(roomy, key=lambda r: ((r.in_flight + 1) * r.turn_ms, r.in_flight, r.name))
        return min(roomy, key=lambda r: (r.in_flight, r.name))
    on_device: dict[str, int] = {}
    for r in state.replicas.values():
        if r.device:
            on_device[r.device] = on_device.get(r.device, 0) + r.in_flight
    if interactive:
        return min(roomy, key=lambda r: (on_device[r.device], r.interactive_runs, r.interactive_tokens,
                                         -r.in_flight, r.name) if r.device
                   else (r.in_flight, 0, 0, r.in_flight, r.name))
    return min(roomy, key=lambda r: (on_device[r.device], -r.in_flight, r.name) if r.device
               else (r.in_flight, r.in_flight, r.name))


def _timed(state: State, turn_id: str, now_ms: int, token_us: int = 0) -> State:
    """Fold a finished turn's placed-to-finished time, and its time per generated token
    where it was measured (``token_us``), into its replica's moving averages (weight
    1/TURN_TIME_WEIGHT)."""
    turn = state.turns.get(turn_id)
    replica = state.replicas.get(turn.replica) if turn is not None else None
    if replica is None:
        return state
    replica = replica._replace(turn_ms=_averaged(replica.turn_ms, max(1, now_ms - turn.placed_ms)))
    if token_us > 0:
        replica = replica._replace(token_us=_averaged(replica.token_us, token_us))
    return state._replace(replicas=state.replicas.set(replica.name, replica))


def _averaged(average: int, value: int) -> int:
    """A moving average over about TURN_TIME_WEIGHT values (the first one as it is)."""
    return max(1, value if not average else (average * (TURN_TIME_WEIGHT - 1) + value) // TURN_TIME_WEIGHT)


def _hold(state: State, turn: HeldTurn) -> State:
    home = _pin(state, state.runs.get(turn.run_id))
    if turn.allowed and home not in turn.allowed:
        home = ""  # pinned outside the replicas it may go to: filed as free to go (within them)
    turn = turn._replace(home=home)
    by_class = state.held_queues.get(turn.home, Map())
    by_caller = by_class.get(turn.service_class, Map())
    key = (turn.caller, turn.opens)
    queue = by_caller.get(key, ()) + (turn.turn_id,)
    by_class = by_class.set(turn.service_class, by_caller.set(key, queue))
    return state._replace(
        held=state.held.set(turn.turn_id, turn),
        held_queues=state.held_queues.set(turn.home, by_class),
        held_by_run=state.held_by_run.set(turn.run_id, state.held_by_run.get(turn.run_id, ()) + (turn.turn_id,)),
    )


def _unhold(state: State, turn_id: str) -> State:
    turn = state.held[turn_id]
    by_class = state.held_queues[turn.home]
    by_caller = by_class[turn.service_class]
    key = (turn.caller, turn.opens)
    by_caller = _set_or_drop(by_caller, key, tuple(t for t in by_caller[key] if t != turn_id))
    by_class = _set_or_drop(by_class, turn.service_class, by_caller)
    run_turns = tuple(t for t in state.held_by_run[turn.run_id] if t != turn_id)
    return state._replace(
        held=state.held.delete(turn_id),
        held_queues=_set_or_drop(state.held_queues, turn.home, by_class),
        held_by_run=_set_or_drop(state.held_by_run, turn.run_id, run_turns),
    )


def _drop_held(state: State, turn: HeldTurn) -> State:
    """A held turn given up (shed, or answered without a place): out of the queue, its
    ownership dropped; a run it opened, if none of its turns was placed and none is
    held, forgotten (it never ran)."""
    state = _unhold(state, turn.turn_id)
    state = state._replace(turn_owner=_set_or_drop(state.turn_owner, turn.turn_id, None))
    run = state.runs.get(turn.run_id)
    if turn.opens and run is not None and not run.replica and turn.run_id not in state.held_by_run:
        state = _put_run(state, None, run_id=turn.run_id)
        state = state._replace(run_owner=_set_or_drop(state.run_owner, turn.run_id, None))
    return state


def _rehome(state: State, run_id: str) -> State:
    """Refile a run's held turns after its pin changed (stage or replica)."""
    for turn_id in state.held_by_run.get(run_id, ()):
        turn = state.held[turn_id]
        state = _hold(_unhold(state, turn_id), turn)
    return state


def _set_or_drop(mapping: Map, key: str, value: object) -> Map:
    """Set ``key`` to ``value``, or drop it when the value is empty."""
    if value:
        return mapping.set(key, value)
    return mapping.delete(key) if key in mapping else mapping


def _place(state: State, turn: HeldTurn, replica: Replica, now_ms: int) -> State:
    run = state.runs.get(turn.run_id) or Run(turn.run_id, turn.service_class, turn.caller, started_ms=now_ms)
    state = _put_run(state, run._replace(replica=replica.name, stage=Stage.GENERATING, last_seen_ms=now_ms,
                                         turns=run.turns + 1))
    placed = Turn(turn.turn_id, turn.run_id, turn.model, turn.service_class, turn.caller, replica.name, now_ms,
                  tokens=run.context_tokens)
    state = _unhold(state, turn.turn_id)
    state = state._replace(turns=state.turns.set(turn.turn_id, placed))
    return _count_in_flight(state, placed, +1)


def _count_in_flight(state: State, turn: Turn, delta: int) -> State:
    """The turn in flight on its replica and for its caller (+1), or no longer (-1): its
    tokens (Turn.tokens) added to or taken from the replica's in_flight_tokens."""
    replicas = state.replicas
    replica = replicas.get(turn.replica)
    if replica is not None:
        interactive = delta if turn.service_class == INTERACTIVE else 0
        replicas = replicas.set(turn.replica, replica._replace(
            in_flight=max(0, replica.in_flight + delta),
            in_flight_tokens=max(0, replica.in_flight_tokens + delta * turn.tokens),
            interactive_in_flight=max(0, replica.interactive_in_flight + interactive)))
    return state._replace(replicas=replicas, running_by_caller=_add(state.running_by_caller, turn.caller, delta))


def _lease_slot(state: State, dataplane: str, replica_name: str, delta: int) -> State:
    """A lent slot turns busy (+1) or idle again (-1)."""
    key = (dataplane, replica_name)
    lease = state.leases.get(key)
    replica = state.replicas.get(replica_name)
    if lease is None or replica is None:
        return state
    busy = max(0, lease.busy + delta)
    idle = max(0, replica.leased_idle + lease.busy - busy)
    return state._replace(leases=state.leases.set(key, lease._replace(busy=busy)),
                          replicas=state.replicas.set(replica_name, replica._replace(leased_idle=idle)))


def _add(counts: Map, key: str, delta: int) -> Map:
    """Add to a counter map, dropping keys that reach zero."""
    value = max(0, counts.get(key, 0) + delta)
    if value:
        return counts.set(key, value)
    return counts.delete(key) if key in counts else counts


def _paused_interactive(run: Run | None) -> tuple[str, int] | None:
    """The replica an interactive run paused on a tool holds a reserve on, and the
    run's context in tokens."""
    if run is not None and run.stage is Stage.PAUSED and run.service_class == INTERACTIVE and run.replica:
        return run.replica, run.context_tokens
    return None


def _pinned_interactive(run: Run | None) -> tuple[str, int] | None:
    """The replica an interactive run under way (generating or paused on a tool) is
    served on, and the run's context in tokens."""
    if run is not None and run.stage is not Stage.IDLE and run.service_class == INTERACTIVE and run.replica:
        return run.replica, run.context_tokens
    return None


def _put_run(state: State, run: Run | None, run_id: str | None = None) -> State:
    """Store (or, with ``run=None``, drop) a run, keeping replicas' reserves and their
    interactive runs' counts in step."""
    key = run.run_id if run is not None else run_id
    previous = state.runs.get(key)
    before = _paused_interactive(previous)
    after = _paused_interactive(run)
    replicas = _moved(state.replicas, _pinned_interactive(previous), _pinned_interactive(run),
                      "interactive_runs", "interactive_tokens")
    replicas = _moved(replicas, before, after, "paused_interactive", "paused_interactive_tokens")
    if state.policy.resume_slots and (before is not None or after is not None):
        replicas = _resumes_after(state, replicas, key, before, run)
    pin_before = _pin(state, previous)
    runs = state.runs.set(key, run) if run is not None else (state.runs.delete(key) if key in state.runs else state.runs)
    state = state._replace(runs=runs, replicas=replicas)
    if key in state.held_by_run and _pin(state, run) != pin_before:
        state = _rehome(state, key)
    return state


def _moved(replicas: Map, before: tuple[str, int] | None, after: tuple[str, int] | None, runs: str,
           tokens: str) -> Map:
    """The replicas with a run counted in their fields ``runs`` and ``tokens`` moved from
    ``before`` to ``after`` (each the replica and the run's context, or None: not counted)."""
    if before == after:
        return replicas
    for counted, sign in ((before, -1), (after, +1)):
        if counted is not None and counted[0] in replicas:
            r = replicas[counted[0]]
            replicas = replicas.set(counted[0], r._replace(**{
                runs: max(0, getattr(r, runs) + sign),
                tokens: max(0, getattr(r, tokens) + sign * counted[1]),
            }))
    return replicas


def _resumes_after(state: State, replicas: Map, run_id: str, before: tuple[str, int] | None,
                   run: Run | None) -> Map:
    """The replicas' lists of expected returns (resume.py) after a change of ``run_id``,
    which was paused as ``before`` and is now ``run``."""
    back_ms = None
    if run is not None and _paused_interactive(run) is not None:
        pause = expected_pause_ms(state, run)
        back_ms = run.last_seen_ms + pause if pause else None
    home = run.replica if back_ms is not None else None
    if before is not None and before[0] != home and before[0] in replicas:
        replicas = replicas.set(before[0], with_resume(replicas[before[0]], run_id, None))
    if home is not None and home in replicas:
        replicas = replicas.set(home, with_resume(replicas[home], run_id, back_ms))
    return replicas


def _end_turn(state: State, turn_id: str, stage: Stage, now_ms: int, context_tokens: int | None = None,
              generated_tokens: int = 0) -> State:
    turn = state.turns.get(turn_id)
    if turn is None:
        return state
    state = state._replace(turns=state.turns.delete(turn_id))
    state = _count_in_flight(state, turn, -1)
    if turn.leased_by:  # its slot goes back to the lease
        state = _lease_slot(state, turn.leased_by, turn.replica, -1)
    run = state.runs.get(turn.run_id)
    if run is not None:
        ended = {"replica": turn.replica, "stage": stage, "last_seen_ms": now_ms}
        if context_tokens is not None:
            ended["context_tokens"] = max(0, context_tokens)
        if generated_tokens > 0:
            ended["generated_tokens"] = run.generated_tokens + generated_tokens
        state = _put_run(state, run._replace(**ended))
    return state


def _cancel(state: State, event: AdmitCancelled) -> State:
    if event.turn_id in state.held:
        return _unhold(state, event.turn_id)
    # Placed but the client left before (or while) it was sent: free the slot.
    return _end_turn(state, event.turn_id, Stage.IDLE, event.now_ms)


def _usage(state: State, event: TurnUsage) -> State:
    """Remember how large the turn's run has grown (its paused prefix is that size)."""
    turn = state.turns.get(event.turn_id)
    run = state.runs.get(turn.run_id) if turn is not None else None
    if run is None:
        return state
    return _put_run(state, run._replace(context_tokens=max(0, event.prompt_tokens + event.completion_tokens),
                                        generated_tokens=run.generated_tokens + max(0, event.completion_tokens)))
