"""The scheduler's imperative shell: turns RPCs, probe results and clock ticks into
events for the decision core, and performs the actions it returns. Its gRPC face is in
scheduler/grpc_api.py, its HTTP side (the status page, ``/status``, ``/ready``,
``/metrics``) in scheduler/app.py."""

from __future__ import annotations

import asyncio
import time
from statistics import median
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from luftpause.proto import scheduler_pb2 as pb
from luftpause.scheduler import core
from luftpause.scheduler.constants import CLOCK_TICK_S, DATAPLANE_GONE_S, FIRST_PROBE_WAIT_S, PROBE_PERIOD_S
from luftpause.scheduler.metrics import SchedulerMetrics
from luftpause.scheduler.pool import Endpoint
from luftpause.scheduler.engine_sessions import EngineSessions
from luftpause.scheduler.engine_slots import EngineSlots
from luftpause.scheduler.probes import ProbeResult, answers, native_apis, probe, probe_client, server_info
from luftpause.vocabulary import BATCH, INTERACTIVE

if TYPE_CHECKING:
    from luftpause.scheduler.app import RunQuery

CLASS_NAMES = {pb.INTERACTIVE: INTERACTIVE, pb.BATCH: BATCH}
STAGES = {pb.IDLE: core.Stage.IDLE, pb.GENERATING: core.Stage.GENERATING, pb.PAUSED: core.Stage.PAUSED}


def class_name(value: int) -> str:
    """Unspecified means interactive (the dataplane's default); unknown values stay
    unknown so the core rejects them."""
    if value == pb.SERVICE_CLASS_UNSPECIFIED:
        return INTERACTIVE
    return CLASS_NAMES.get(value, f"class-{value}")


class SchedulerHost:
    """Owns the state; every change goes through :meth:`apply` on the event loop.
    ``policy``: the operator's switches (the shipped ones unless told otherwise)."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        log,
        clock: Callable[[], float] = time.monotonic,
        policy: core.Policy = core.Policy(),
        probe_period_s: float = PROBE_PERIOD_S,
        first_probe_wait_s: float = FIRST_PROBE_WAIT_S,
        dataplane_gone_s: float = DATAPLANE_GONE_S,
    ) -> None:
        self.probe_period_s = probe_period_s
        self.dataplane_gone_s = dataplane_gone_s
        self.endpoints = {e.name: e for e in endpoints}
        # Client APIs an engine serves itself, read from it when its pool entry lists none.
        self._discovered_apis: dict[str, tuple[str, ...]] = {}
        self.sessions = EngineSessions(self.endpoints, log)  # the engines' hints and sessions of runs
        self.slots = EngineSlots()  # each run's engine slot where engines have slots (llama.cpp)
        self._clock = clock
        self.state = core.initial_state((e.replica() for e in endpoints), policy,
                                        first_probe_deadline_ms=self.now_ms() + int(first_probe_wait_s * 1000))
        self.log = log
        self._streams: dict[str, int] = {}  # dataplane id -> open Connect and Report streams
        self._lenders: dict[str, object] = {}  # dataplane id -> its Connect stream that takes leases
        # turn id -> who waits for its decision (a unary Admit call or a Connect stream)
        self._waiters: dict[str, list[Callable[[core.Action], None]]] = {}
        self._logged_problems: set[str] = set()  # metrics URLs already logged as unreadable
        self._stale_logged: set[str] = set()  # replicas whose metrics time out, logged once per spell
        self._unseen_since: dict[str, float] = {}  # replicas out of sight: since when (clock seconds)
        self.metrics = SchedulerMetrics(self.status, clock)
        self.metrics.init_series(self.endpoints)
        self.serving = False  # set once the gRPC server is up (readiness)
        self.standby = ""  # another scheduler leads: the lead lock's database (scheduler/leader.py)
        self._probe_client: httpx.AsyncClient | None = None
        self._reprobing: set[str] = set()  # replicas probed out of turn right now
        self._tasks: set[asyncio.Task] = set()

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    def apply(self, event: core.Event) -> None:
        before = self.state
        self.state, actions = core.decide(self.state, event)
        self.metrics.applied(before, event, self.state, actions)
        self._engine_sessions(event)
        for action in actions:
            if isinstance(action, (core.Grant, core.Revoke)):
                self._lend(action)
                continue
            if isinstance(action, core.Place) and (turn := self.state.turns.get(action.turn_id)) is not None:
                self.sessions.placed(turn.run_id, turn.service_class, action.replica)
                self._choose_slot(turn.run_id, action.replica)
            self._log_decision(action)
            for waiter in self._waiters.pop(action.turn_id, ()):
                waiter(action)

    def _engine_sessions(self, event: core.Event) -> None:
        """Follow the runs with an engine session open (scheduler/engine_sessions.py)."""
        if isinstance(event, core.AdmitRequested) and event.leased_replica:
            self.sessions.placed(event.run_id, event.service_class, event.leased_replica)
        elif isinstance(event, (core.RunEnded, core.ClockTicked)):
            self.sessions.settle(self.state, self._probe_client)
            self.slots.settle(self.state)
        elif isinstance(event, core.Resynced):  # runs brought back after a restart
            for run in self.state.runs.values():
                if run.replica:
                    self.sessions.placed(run.run_id, run.service_class, run.replica)

    def _choose_slot(self, run_id: str, replica: str) -> None:
        """The run's engine slot for its turn placed on the replica, where its engine has
        slots (scheduler/engine_slots.py); :meth:`hints` sends it with the placement."""
        endpoint = self.endpoints.get(replica)
        slots = self.sessions.of(endpoint).slots if endpoint is not None else 0
        if slots:
            self.slots.take(self.state, replica, run_id, slots, self.now_ms())

    def _log_decision(self, action: core.Action) -> None:
        """One debug line per admission decision."""
        if isinstance(action, core.Place):
            turn = self.state.turns.get(action.turn_id)
            self.log.debug("admit_decision", decision="place", turn=action.turn_id, replica=action.replica,
                           held_ms=action.held_ms, run=turn.run_id if turn else None,
                           service_class=turn.service_class if turn else None, caller=turn.caller if turn else None)
        else:
            self.log.debug("admit_decision", decision="reject", turn=action.turn_id, reason=action.reason,
                           message=action.message)

    async def admit(self, request: pb.AdmitRequest) -> core.Action:
        """Wait until the turn is placed or rejected; cancelling abandons it."""
        waiter: asyncio.Future[core.Action] = asyncio.get_running_loop().create_future()

        def decided(action: core.Action) -> None:
            if not waiter.done():
                waiter.set_result(action)

        try:
            self.request_admit(request, decided, request.dataplane_id)
            return await waiter
        except asyncio.CancelledError:
            self.withdraw(request.turn_id, request.run_id, decided)
            raise

    def request_admit(self, request: pb.AdmitRequest, decided: Callable[[core.Action], None], dataplane: str) -> None:
        """Ask for a turn's placement; ``decided`` is called once with the core's answer
        (at once, or when a held turn is released)."""
        self._waiters.setdefault(request.turn_id, []).append(decided)
        self.apply(self._admit_event(request, dataplane, leased=False))

    def _admit_event(self, request: pb.AdmitRequest, dataplane: str, leased: bool) -> core.AdmitRequested:
        """The core's event for an admission; ``leased``: news of a turn placed on a lent
        slot (a question, a unary Admit included, never is: it waits for its answer)."""
        return core.AdmitRequested(
            turn_id=request.turn_id,
            run_id=request.run_id,
            model=request.model,
            service_class=class_name(request.service_class),
            caller=request.caller,
            now_ms=self.now_ms(),
            one_pass=request.one_pass,
            dataplane=dataplane,
            leased_replica=request.leased_replica if leased else "",
            allowed=frozenset(request.allowed_replicas),
            shed_batch_held=request.shed_batch_held,
        )

    def leased_admit(self, request: pb.AdmitRequest, dataplane: str) -> None:
        """A turn the dataplane placed itself on a slot of its lease (no decision follows)."""
        self.apply(self._admit_event(request, dataplane, leased=True))

    def lease_returned(self, dataplane: str, returned: pb.LeaseReturn) -> None:
        self.apply(core.LeaseReturned(dataplane, returned.replica, returned.slots, self.now_ms()))

    def lender_opened(self, dataplane: str, stream) -> None:
        """A Connect stream that takes leases: grants and revokes for its dataplane go there."""
        self._lenders[dataplane] = stream
        self.apply(core.LeaseTaking(dataplane, True, self.now_ms()))

    def lender_closed(self, dataplane: str, stream) -> None:
        if self._lenders.get(dataplane) is not stream:
            return  # a newer stream of the same dataplane took over
        del self._lenders[dataplane]
        self.apply(core.LeaseTaking(dataplane, False, self.now_ms()))

    def _lend(self, action: core.Grant | core.Revoke) -> None:
        stream = self._lenders.get(action.dataplane)
        if stream is None:  # its stream ended: the core voids the lease with LeaseTaking
            return
        if isinstance(action, core.Grant):
            stream.grant(self.endpoints[action.replica], action.slots)
            self.log.debug("lease", action="grant", dataplane=action.dataplane, replica=action.replica,
                           slots=action.slots)
        else:
            stream.revoke(action.replica)
            self.log.debug("lease", action="revoke", dataplane=action.dataplane, replica=action.replica)

    def withdraw(self, turn_id: str, run_id: str, decided: Callable[[core.Action], None]) -> None:
        """``decided`` no longer waits (its caller left); once nobody waits for a held
        turn, the turn is abandoned."""
        waiters = self._waiters.get(turn_id)
        if waiters is None or decided not in waiters:
            return  # decided already
        waiters.remove(decided)
        if waiters:
            return
        del self._waiters[turn_id]
        if turn_id in self.state.held:
            self.log.info("turn_abandoned", turn=turn_id, run=run_id)
            self.apply(core.AdmitCancelled(turn_id, self.now_ms()))

    def report(self, event: pb.TurnEvent, usage: pb.Usage | None = None) -> None:
        """Apply a turn event; ``usage``: the turn's Usage event, sent just before its
        ``finished`` one, applied with it in one step."""
        now = self.now_ms()
        kind = event.WhichOneof("kind")
        if kind == "first_token":
            self.metrics.recent.first_token(event.first_token.ttft_ms)
            silent = self._silent_replica(event.turn_id)
            if silent is not None:  # it speaks (stalls.py); reported only then, to keep first tokens cheap
                self._speaks(silent, core.TurnAnswered(event.turn_id, now))
        elif kind == "silent":
            placed = self.state.turns.get(event.turn_id)
            if placed is not None:
                was = self.state.replicas[placed.replica]
                self.apply(core.TurnSilent(event.turn_id, now))
                if not was.silent and self.state.replicas[placed.replica].silent:
                    self.log.warning("replica_silent", replica=placed.replica, turn=event.turn_id,
                                     effect="no new turns until a byte comes from it")
        elif kind == "usage":
            self.apply(core.TurnUsage(event.turn_id, event.usage.prompt_tokens, event.usage.completion_tokens, now))
        elif kind == "finished":
            tokens = None if usage is None else usage.prompt_tokens + usage.completion_tokens
            self._speaks(self._silent_replica(event.turn_id),
                         core.TurnFinished(event.turn_id, event.finished.finish_reason, now, tokens,
                                           0 if usage is None else usage.completion_tokens,
                                           event.finished.token_us))
        elif kind == "failed":
            self.log.info("turn_failed", turn=event.turn_id, run=event.run_id, error=event.failed.error,
                          stalled=event.failed.stalled)
            placed = self.state.turns.get(event.turn_id)
            if placed is not None and event.failed.stalled and not self.state.replicas[placed.replica].stalled:
                self.log.warning("replica_stalled", replica=placed.replica, turn=event.turn_id,
                                 error=event.failed.error, effect="out of rotation until it answers a probe generation")
            self.apply(core.TurnFailed(event.turn_id, now, stalled=event.failed.stalled))
            if placed is not None:
                self.reprobe(placed.replica)
        elif kind == "abandoned":
            self.apply(core.AdmitCancelled(event.turn_id, now))
        elif kind == "run_ended":
            self.apply(core.RunEnded(event.run_id, now))
        # started changes nothing (this dataplane no longer sends it); first_token is counted above.

    def _silent_replica(self, turn_id: str) -> str | None:
        """The replica of the turn in flight if it has silent turns (stalls.py), else None."""
        placed = self.state.turns.get(turn_id)
        return placed.replica if placed is not None and self.state.replicas[placed.replica].silent else None

    def _speaks(self, silent: str | None, event: core.Event) -> None:
        """Apply a byte from the turn's replica (a first token, a finished turn); ``silent``:
        that replica, when it had silent turns (:meth:`_silent_replica`), logged if now back."""
        self.apply(event)
        if silent is not None and not self.state.replicas[silent].silent:
            self.log.info("replica_speaks", replica=silent, effect="back in rotation")

    def resync(self, request: pb.ResyncRequest) -> None:
        """Apply one dataplane's snapshot (protocol 1's Resync, the Hello of protocols 2 and 3)."""
        runs = tuple(
            core.RunSnapshot(r.run_id, r.replica, STAGES.get(r.stage, core.Stage.IDLE), class_name(r.service_class), r.caller)
            for r in request.runs
        )
        turns = tuple(
            core.TurnSnapshot(t.turn_id, t.run_id, t.replica, t.model, class_name(t.service_class), t.caller)
            for t in request.turns
        )
        self.apply(core.Resynced(runs, turns, self.now_ms(), request.dataplane_id))
        self.log.info("resynced", dataplane=request.dataplane_id, runs=len(runs), turns=len(turns))

    def stream_opened(self, dataplane: str) -> None:
        self._streams[dataplane] = self._streams.get(dataplane, 0) + 1

    def stream_closed(self, dataplane: str) -> None:
        """The dataplane's Connect (or Report) stream ended: unless it is back within DATAPLANE_GONE_S
        (then its Resync speaks for its turns), its in-flight turns died with it."""
        self._streams[dataplane] = self._streams.get(dataplane, 1) - 1
        if self._streams[dataplane] > 0:
            return

        async def check() -> None:
            await asyncio.sleep(self.dataplane_gone_s)
            if self._streams.get(dataplane, 0) <= 0:
                self._streams.pop(dataplane, None)
                self.log.info("dataplane_gone", dataplane=dataplane)
                self.apply(core.DataplaneGone(dataplane, self.now_ms()))

        task = asyncio.get_running_loop().create_task(check())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def status(self) -> dict:
        """The core's picture, with each replica's address from the pool after its name and
        the engine hints it is sent."""
        view = core.status(self.state, self.now_ms())
        view["replicas"] = [{"name": r["name"], "base_url": self.endpoints[r["name"]].base_url, **r,
                             "hints": self.sessions.of(self.endpoints[r["name"]]).as_fields()}
                            for r in view["replicas"]]
        return view

    def run_page(self, query: RunQuery) -> dict:
        return core.run_page(self.state, self.now_ms(), query.limit, query.cursor, query.caller, query.stage,
                             query.service_class)

    async def probe_forever(self) -> None:
        """Every endpoint on its own clock: one whose probe waits out the timeout (a
        partition, a wedged route) delays no other endpoint's readings."""
        async with probe_client() as client:
            self._probe_client = client
            await asyncio.gather(*(self._probe_endpoint_forever(client, e) for e in self.endpoints.values()))

    async def _probe_endpoint_forever(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        while True:
            started = time.monotonic()
            result, answered = await self._probe(client, endpoint)
            # The fast batch and the native APIs are read, side by side, on the first
            # healthy probe of each healthy spell (out of sight and back is the same spell).
            known = self.state.replicas[endpoint.name]
            fast = slots = None
            if result.healthy and not (known.healthy or known.unseen):
                info, _ = await asyncio.gather(
                    server_info(client, endpoint),
                    self._discover_apis(client, [endpoint] if endpoint.native_apis is None else []))
                fast = info.fast_batch
                self.sessions.learned(endpoint, info.hints)
                slots = self.sessions.of(endpoint).slots
            self._probe_result(endpoint.name, result, fast, answered, slots)
            await asyncio.sleep(max(0.0, self.probe_period_s - (time.monotonic() - started)))

    def hints(self, endpoint: Endpoint, run_id: str = "") -> pb.EngineHints | None:
        """The replica's engine hints as sent to dataplanes (None: it reads none), with
        the engine slot of ``run_id``'s turn placed there, where it has slots."""
        hints = self.sessions.of(endpoint)
        if not hints:
            return None
        message = pb.EngineHints(priority=hints.priority, sessions=hints.sessions, slots=hints.slots)
        slot = self.slots.of(endpoint.name, run_id) if hints.slots and run_id else None
        if slot is not None:
            message.slot = slot
        return message

    def native_apis(self, endpoint: Endpoint) -> tuple[str, ...]:
        """The client APIs besides chat completions the replica serves itself: its pool
        entry's list, else what the engine's /openapi.json listed."""
        if endpoint.native_apis is not None:
            return endpoint.native_apis
        return self._discovered_apis.get(endpoint.name, ())

    async def _discover_apis(self, client: httpx.AsyncClient, endpoints: list[Endpoint]) -> None:
        """Read, once per healthy spell, which client APIs each engine serves itself (an
        engine that went away may come back as another version)."""
        found = await asyncio.gather(*(native_apis(client, e) for e in endpoints))
        for endpoint, apis in zip(endpoints, found, strict=True):
            if apis != self._discovered_apis.get(endpoint.name, ()):
                self.log.info("engine_native_apis", replica=endpoint.name, native_apis=list(apis),
                              effect="their turns pass through unchanged" if apis else "all turns translated")
            self._discovered_apis[endpoint.name] = apis

    async def _probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> tuple[ProbeResult, bool | None]:
        """Health and load; for a stalled (or silent) replica that says it is healthy, also
        whether it answers a probe generation (None: none sent)."""
        result = await probe(client, endpoint)
        known = self.state.replicas[endpoint.name]
        if not (result.healthy and (known.stalled or known.silent)):
            return result, None
        slots = self.sessions.of(endpoint).slots
        spare = self.slots.spare(self.state, endpoint.name, slots) if slots else None  # a slot holding no run's KV
        return result, await answers(client, endpoint, spare)

    def _probe_result(self, replica: str, result: ProbeResult, fast: int | None = None,
                      answered: bool | None = None, slots: int | None = None) -> None:
        self._log_probe(replica, result)
        self.metrics.probed(replica, result.healthy)
        if fast:
            self.log.info("engine_fast_batch", replica=replica, fast_batch=fast)
        if answered and (self.state.replicas[replica].stalled or self.state.replicas[replica].silent):
            self.log.info("replica_answers", replica=replica, effect="back in rotation")
        known = self.state.replicas[replica]
        before = known.decode
        self.apply(core.EngineProbed(replica, result.healthy, result.running, result.queued, self.now_ms(),
                                     result.kv_used, result.kv_total, fast, answers=answered,
                                     load_stale=result.load_stale, unanswered=result.unanswered,
                                     gen_throughput=result.gen_throughput, queue_wait_s=result.queue_wait_s,
                                     queue_waits=result.queue_waits, decode_counters=result.decode_counters,
                                     engine_slots=slots))
        after = self.state.replicas[replica]
        if after.limit.value != known.limit.value:
            self.log.info("admission_limit", replica=replica, limit=after.limit.value, was=known.limit.value,
                          running=result.running, queued=result.queued, in_flight=after.in_flight,
                          calm_needed=after.limit.calm_needed)
        if after.decode.lift != before.lift:
            self.log.info("decode_ceiling", replica=replica, ceiling=after.ceiling, fast_batch=after.fast_batch,
                          ms_per_token_at_fast_batch=round(median(before.lo_costs), 2) if before.lo_costs else None,
                          ms_per_token_above=round(median(before.hi_costs), 2) if before.hi_costs else None,
                          effect="lifted" if after.decode.lift > before.lift else "lowered",
                          batch_first=after.decode.batch_first)

    def reprobe(self, replica: str) -> None:
        """Probe one replica now, out of turn: a turn failed there, and a dead engine
        should stop taking the retries of the turns it failed (one probe at a time)."""
        endpoint = self.endpoints.get(replica)
        if endpoint is None or self._probe_client is None or replica in self._reprobing:
            return
        self._reprobing.add(replica)

        async def run() -> None:
            try:
                result = await probe(self._probe_client, endpoint)
                if not result.healthy:  # load stays the periodic probes' business
                    self._probe_result(replica, result)
            finally:
                self._reprobing.discard(replica)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _log_probe(self, replica: str, result: ProbeResult) -> None:
        known = self.state.replicas[replica]
        if result.unanswered and known.healthy and not known.stalled:
            self._unseen_since[replica] = self._clock()
            self.log.warning("replica_unseen", replica=replica, url=self.endpoints[replica].probed_at,
                             effect="its health probe went unanswered: runs pinned there stay, new runs go elsewhere")
        elif known.unseen and not result.unanswered:
            since = self._unseen_since.pop(replica, None)
            self.log.info("replica_seen", replica=replica, healthy=result.healthy,
                          unseen_s=None if since is None else round(self._clock() - since, 3))
        elif result.healthy != known.healthy and not (known.unseen and result.unanswered):
            self.log.info("replica_health", replica=replica, healthy=result.healthy)
        if result.load_stale and replica not in self._stale_logged:
            self._stale_logged.add(replica)
            self.log.warning("engine_metrics_unanswered", replica=replica,
                             effect="load unknown: its limit is kept and does not grow")
        elif not result.load_stale:
            self._stale_logged.discard(replica)
        for url, problem in result.problems:
            if url not in self._logged_problems:
                self._logged_problems.add(url)
                self.log.warning("engine_metrics_unreadable", replica=replica, url=url, problem=problem,
                                 effect="treated as reporting no load")

    async def tick_forever(self) -> None:
        while True:
            await asyncio.sleep(CLOCK_TICK_S)
            self.apply(core.ClockTicked(self.now_ms()))
