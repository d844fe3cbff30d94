"""A continuously batching engine, as a model without clocks or I/O.

The fake engine's timing comes from here. The model follows SGLang's scheduler on one
GPU (``schedule_policy.py``'s ``PrefillAdder``, ``schedule_batch.py``'s
``retract_decode``, ``scheduler.py``'s loop, ``radix_cache.py``) item by item:

- **Prefill before decode.** Each iteration first tries to build a prefill batch from
  the waiting queue (first come, first served); only when none can be built does the
  running batch take one decode step.
- **Chunked prefill.** One prefill pass takes at most ``chunked_prefill_tokens`` new
  tokens (2,048 on GPUs under 20 GB); a longer prompt is cut, its unfinished rest
  continues first in the next prefill pass, and it joins the decode batch only when its
  prompt is complete. So the queue can be non-empty while KV still has room.
- **Admission accounting** (``PrefillAdder``). A waiting request is admitted when its
  uncached tokens + min(remaining max_new_tokens, 4096) are below the free + evictable
  pool minus, for every running request, min(its remaining max_new_tokens, 4096) ×
  ``new_token_ratio``. Nothing of the reply is taken at admission: KV grows one token
  per running request per decode step, evicting unused cache first. A refusal for lack
  of tokens marks the batch full: no more admission until a request leaves the batch.
- **new_token_ratio and retraction.** The ratio starts at 0.7 and decays linearly to
  0.7 × 0.14 ≈ 0.1 over 600 decode steps; it is back at 0.7 whenever the engine is idle.
  When a decode step finds no room for one token per request (after evicting cache),
  ``retract_decode`` sends requests back to the end of the queue (fewest generated
  tokens, then longest prompt, first) until 20 tokens per remaining request are free;
  their prompt blocks stay in the cache (evictable), their generated tokens are
  recomputed on re-admission, and the ratio is re-estimated from the remaining batch
  as (generated + 20 × requests) / (max_new_tokens + 1), at most 1.
- **Prefix cache.** Prompts are tokenised at ~4 characters per token and hashed in
  fixed blocks, each hash chained to the one before; a request's cached prefix is the
  run of its leading blocks in the pool. A prompt enters the cache when its prefill is
  done (and a chunk's full blocks when the chunk is); a finished request leaves prompt
  and reply cached. Unused blocks are evicted least recently used, never in use.
- **Costs.** A prefill pass costs ``prefill_base_ms + prefill_ms_per_token × new
  tokens``; a decode step ``decode_base_ms + decode_ms_per_request × batch``, plus
  ``decode_eager_ms`` when the batch is above ``cuda_graph_max_bs`` (SGLang captures
  CUDA graphs only up to that size; larger batches launch kernels one by one).
- **The real engines' agent features, each behind its engine's own flag and off by
  default** (without them a request's ``priority`` and ``session_id`` are ignored):
  vLLM's ``--scheduling-policy priority`` and SGLang's ``--enable-priority-scheduling``
  order the queue and preempt by the request's ``priority`` (:mod:`luftpause.fakes.priority`);
  SGLang's ``--enable-session-radix-cache`` keeps the KV of open sessions ahead of
  unreferenced KV under eviction until ``POST /close_session``
  (:class:`~luftpause.fakes.prefix_cache.SessionRefs`).
- **Gauges** (running, queue, token usage, cache hit rate) are what SGLang's metrics
  show: refreshed after every prefill pass and every ``metrics_interval_steps`` decode
  steps (SGLang's decode log interval, 40), not live. The queue counts retracted
  requests; token usage counts tokens held by running requests (not evictable cache).

:class:`EngineModel` is driven by a loop (see ``engine.py``): ``admit`` and, if it gave
a batch, ``prefill_ms`` then ``finish_prefill``; else ``prepare_decode`` (which may
retract), ``decode_ms`` and ``decode_step``. Durations are model milliseconds, which the
driver multiplies by the time scale.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from luftpause.fakes.prefix_cache import PrefixCache, SessionRefs, block_hashes
from luftpause.fakes.priority import PriorityPolicy, SglangPriority, VllmPriority
from luftpause.fakes.replies import CHARS_PER_TOKEN, tokens_for_chars

__all__ = ["CHARS_PER_TOKEN", "EngineModel", "ModelParams", "PrefixCache", "SimRequest", "block_hashes",
           "tokens_for_chars"]


@dataclass(frozen=True)
class ModelParams:
    """The physical knobs of one replica (see the module doc for what each costs) and
    SGLang's scheduler constants (``environ.py`` / ``server_args.py`` defaults)."""

    max_running: int = 0  # 0 = no limit on the batch (KV still limits it)
    kv_tokens: int = 65536
    block_tokens: int = 16
    context_tokens: int = 8192  # max_new_tokens = context − prompt when a request sets none; 0 = no context
    max_prefill_tokens: int = 16384  # new tokens of one prefill batch at most
    chunked_prefill_tokens: int = 2048  # new tokens one prefill pass takes at most; 0 = no chunking
    prefill_base_ms: float = 20.0
    prefill_ms_per_token: float = 0.0
    decode_base_ms: float = 2.0
    decode_ms_per_request: float = 0.0
    cuda_graph_max_bs: int = 0  # decode batches above this size pay decode_eager_ms; 0 = never
    decode_eager_ms: float = 0.0
    init_new_token_ratio: float = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
    min_new_token_ratio_factor: float = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    new_token_ratio_decay_steps: int = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    clip_max_new_tokens: int = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
    retract_decode_steps: int = 20  # SGLANG_RETRACT_DECODE_STEPS
    metrics_interval_steps: int = 40  # decode steps between gauge refreshes (--decode-log-interval)
    # The real engines' agent features, each behind its engine's flag, all off by default:
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: "priority" orders and preempts by priority
    enable_priority_scheduling: bool = False  # SGLang's --enable-priority-scheduling
    schedule_low_priority_values_first: bool = False  # SGLang: lower values first (default: higher first)
    priority_scheduling_preemption_threshold: int = 10  # SGLang: priority gap needed to preempt
    disable_priority_preemption: bool = False  # SGLang: priority orders the queue only
    enable_session_radix_cache: bool = False  # SGLang: session-tagged KV, evicted last, /close_session

    def priority_policy(self) -> PriorityPolicy | None:
        """The engine's priority scheduling, if a flag turned it on (at most one may)."""
        if self.scheduling_policy == "priority" and self.enable_priority_scheduling:
            raise ValueError("--scheduling-policy priority (vLLM) and --enable-priority-scheduling (SGLang) "
                             "model two engines; choose one")
        if self.scheduling_policy == "priority":
            return VllmPriority()
        if self.scheduling_policy != "fcfs":
            raise ValueError(f"scheduling_policy must be fcfs or priority, not {self.scheduling_policy!r}")
        if self.enable_priority_scheduling:
            return SglangPriority(low_values_first=self.schedule_low_priority_values_first,
                                  threshold=self.priority_scheduling_preemption_threshold,
                                  preemption=not self.disable_priority_preemption)
        return None

    @property
    def block_chars(self) -> int:
        return self.block_tokens * CHARS_PER_TOKEN

    @property
    def min_new_token_ratio(self) -> float:
        return self.init_new_token_ratio * self.min_new_token_ratio_factor

    @property
    def new_token_ratio_decay(self) -> float:
        steps = max(1, self.new_token_ratio_decay_steps)
        return (self.init_new_token_ratio - self.min_new_token_ratio) / steps


@dataclass
class SimRequest:
    """One request in the model: what it needs and how far it got."""

    id: int
    model: str
    prompt_text: str
    prompt_tokens: int
    reply_tokens: int  # tokens it will generate (its planned reply, already capped)
    max_new_tokens: int  # what the scheduler plans for: max_tokens, else context − prompt
    reply_text: str = ""  # cached after the prompt once finished (the next turn's prefix)
    hashes: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0  # prefix hit at its first admission (what usage reports)
    generated: int = 0
    state: str = "new"  # new → waiting → running → finished | aborted (running → waiting on retraction)
    prefilled: bool = False  # its whole prompt (and any recomputed output) is in KV
    computed: int = 0  # tokens of prompt + output in KV while running
    extend_tokens: int = 0  # new tokens of the current prefill pass
    held_blocks: list[bytes] = field(default_factory=list)
    private_tokens: int = 0  # KV tokens held outside shared cache blocks
    admitted_once: bool = False
    prefix_hit: bool = False  # admitted in the current prefill batch (its computed tokens were a cache hit)
    retractions: int = 0  # times sent back to the queue (retracted, or preempted by priority)
    priority: int = 0  # its priority as the engine's priority scheduling reads it (unused without)
    queued_seq: int = 0  # when it last joined the queue, in order (SGLang's wait_queue_entry_time)
    session_id: str | None = None  # its session, with --enable-session-radix-cache only
    session_generation: int | None = None

    @property
    def fill_tokens(self) -> int:
        """Tokens that must be in KV before it can decode: the prompt and its output so far."""
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.prefilled and self.generated >= self.reply_tokens


@dataclass
class Counters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    evicted_blocks: int = 0
    decode_steps: int = 0
    retractions: int = 0


@dataclass(frozen=True)
class Gauges:
    """What ``/metrics`` shows: a snapshot, refreshed as SGLang refreshes its gauges."""

    running: dict[str, int] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0


@dataclass
class _PrefillRoom:
    """What is left of one prefill batch's room while it is built (SGLang's ``PrefillAdder``):
    ``offset``, the KV the running requests and the batch are expected to need (their
    remaining max_new_tokens, clipped, × ``ratio``, the new_token_ratio it was built with);
    ``rem_input``, new tokens the batch still takes; ``rem_chunk``, new tokens the pass still
    takes under chunked prefill (None without)."""

    ratio: float
    offset: float
    rem_input: int
    rem_chunk: int | None
    batch: list[SimRequest] = field(default_factory=list)

    def spend(self, extend: int) -> None:
        """``extend`` new tokens taken into the batch."""
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend


class EngineModel:
    """The batch, the queue and the KV pool of one replica."""

    def __init__(self, params: ModelParams) -> None:
        self.params = params
        self.cache = PrefixCache()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []  # the decode batch (prompts complete)
        self.chunked: SimRequest | None = None  # a prompt part-way through chunked prefill
        self.counters = Counters()
        self.new_token_ratio = params.init_new_token_ratio
        self.batch_is_full = False
        self.gauges = Gauges()
        self._next_id = 0
        self._decode_batch: list[SimRequest] | None = None
        self._last_hit_rate = 0.0
        self._queued = 0
        self.priority = params.priority_policy()
        self.sessions = SessionRefs(self.cache) if params.enable_session_radix_cache else None

    # --- accounting --------------------------------------------------------------------

    def _active(self) -> list[SimRequest]:
        return self.running + ([self.chunked] if self.chunked is not None else [])

    @property
    def private_tokens(self) -> int:
        return sum(r.private_tokens for r in self._active())

    @property
    def used_tokens(self) -> int:
        """KV tokens held by running requests (evictable cached blocks excluded)."""
        in_use = (len(self.cache) - self.cache.evictable) * self.params.block_tokens
        return in_use + self.private_tokens

    @property
    def pool_tokens(self) -> int:
        """KV tokens taken, evictable cache included."""
        return len(self.cache) * self.params.block_tokens + self.private_tokens

    @property
    def free_tokens(self) -> int:
        return self.params.kv_tokens - self.pool_tokens

    def token_usage(self) -> float:
        return min(1.0, self.used_tokens / self.params.kv_tokens) if self.params.kv_tokens > 0 else 0.0

    def cache_hit_rate(self) -> float:
        """Share of prompt tokens served from cache since the start (first admissions)."""
        c = self.counters
        return c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0

    def _evict_for(self, tokens: int, protect: Sequence[bytes] = ()) -> None:
        """Evict unused blocks until ``tokens`` are free (or nothing more can go)."""
        shortfall = tokens - self.free_tokens
        if shortfall <= 0:
            return
        self.cache.acquire(protect)
        self.counters.evicted_blocks += self.cache.evict(-(-shortfall // self.params.block_tokens))
        self.cache.release(protect)

    def _clipped_left(self, request: SimRequest) -> int:
        return min(max(0, request.max_new_tokens - request.generated), self.params.clip_max_new_tokens)

    def refresh_gauges(self) -> None:
        self.gauges = Gauges(
            running=dict(Counter(r.model for r in self.running)),
            queued=dict(Counter(r.model for r in self.waiting)),
            token_usage=self.token_usage(),
            cache_hit_rate=self._last_hit_rate,
        )

    # --- lifecycle -----------------------------------------------------------------------

    def submit(self, model: str, prompt_text: str, reply_tokens: int, max_tokens: int | None,
               reply_text: str = "", priority: int | None = None, session_id: str | None = None) -> SimRequest:
        """Queue a request; ``reply_tokens`` is its planned length (≤ ``max_tokens``).
        ``priority`` and ``session_id`` count only when the engine's flags turn them on."""
        prompt_tokens = tokens_for_chars(len(prompt_text))
        if self.params.context_tokens > 0:  # a reply can never outgrow the context
            left = max(1, self.params.context_tokens - prompt_tokens)
            max_new = min(max_tokens, left) if max_tokens is not None else left
        else:  # no context modelled: without max_tokens the scheduler plans for the planned reply
            max_new = max_tokens if max_tokens is not None else reply_tokens
        request = SimRequest(
            id=self._next_id, model=model, prompt_text=prompt_text, prompt_tokens=prompt_tokens,
            reply_tokens=max(0, reply_tokens), max_new_tokens=max(max_new, reply_tokens, 0), reply_text=reply_text,
            hashes=block_hashes(prompt_text, self.params.block_chars),
        )
        self._next_id += 1
        if self.priority is not None:
            request.priority = self.priority.effective(priority)
        if self.sessions is not None and session_id is not None:
            request.session_id, request.session_generation = session_id, self.sessions.begin(session_id)
        request.state = "waiting"
        self._enqueue(request)
        return request

    def _enqueue(self, request: SimRequest) -> None:
        """Join the end of the queue (SGLang's ``_add_request_to_queue``)."""
        self._queued += 1
        request.queued_seq = self._queued
        self.waiting.append(request)

    def _order_waiting(self) -> None:
        """The queue in the priority scheduling's order (before each prefill batch, as
        SGLang's ``calc_priority``; vLLM's is a heap); first come first served without."""
        if self.priority is not None:
            self.waiting = deque(sorted(self.waiting, key=self.priority.waiting_key))

    def close_session(self, session_id: str) -> int:
        """``POST /close_session``: the session's KV is no longer kept ahead of other KV."""
        return self.sessions.close(session_id) if self.sessions is not None else 0

    def _cached_prefix_blocks(self, request: SimRequest) -> int:
        blocks = self.cache.cached_prefix(request.hashes)
        # at least one token is always computed (SGLang keeps the last token out of the match)
        return min(blocks, max(0, request.fill_tokens - 1) // self.params.block_tokens)

    def _rem_total(self, request: SimRequest, offset: float) -> float:
        """PrefillAdder's rem_total_tokens for ``request``: free + evictable (its own cached
        prefix excluded, it is locked first) − what running requests are expected to need."""
        cached = self._cached_prefix_blocks(request)
        own_evictable = sum(1 for b in request.hashes[:cached] if self.cache._users.get(b) == 0)
        evictable = (self.cache.evictable - own_evictable) * self.params.block_tokens
        return self.free_tokens + evictable - offset

    def admit(self) -> list[SimRequest]:
        """Build the next prefill batch (``get_new_batch_prefill``), or [] when there is none.

        The unfinished chunked request continues first; then waiting requests in order
        while the batch has room for requests, new tokens and (by the accounting in the
        module doc) KV. Each returned request has ``extend_tokens`` set for this pass.
        """
        p = self.params
        preempting = isinstance(self.priority, SglangPriority) and self.priority.preemption
        if preempting:  # "Reset batch_is_full to try preemption with a prefill adder."
            self.batch_is_full = False
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return []
        self._order_waiting()
        ratio = self.new_token_ratio
        room = _PrefillRoom(
            ratio=ratio, offset=sum(self._clipped_left(r) * ratio for r in self.running),
            rem_input=p.max_prefill_tokens,
            rem_chunk=p.chunked_prefill_tokens if p.chunked_prefill_tokens > 0 else None)
        running_bs = len(self.running)
        if self.chunked is not None:
            self._continue_chunked(self.chunked, room)
        preempted = self._add_waiting(room, running_bs, preempting)
        for request in preempted:  # back to the queue after the batch is built
            self._enqueue(request)
        batch = room.batch
        if batch:  # SGLang's cache_hit_rate gauge: hits / (hits + new tokens) of the last prefill batch
            hits = sum(r.computed for r in batch if r.prefix_hit)
            new = sum(r.extend_tokens for r in batch)
            self._last_hit_rate = hits / (hits + new) if hits + new else 0.0
        return batch

    def _continue_chunked(self, request: SimRequest, room: _PrefillRoom) -> None:
        """The chunked request's next part, first into the batch; with the last part its
        prompt is complete and it joins the running batch."""
        extend = request.fill_tokens - request.computed
        truncated = room.rem_chunk is not None and extend > room.rem_chunk
        if room.rem_chunk is not None:
            extend = min(extend, room.rem_chunk)
        self._allocate(request, extend)
        room.offset += extend + (0 if truncated else self._clipped_left(request))
        room.spend(extend)
        room.batch.append(request)
        if not truncated:
            self.chunked = None
            self.running.append(request)

    def _add_waiting(self, room: _PrefillRoom, running_bs: int, preempting: bool) -> list[SimRequest]:
        """Waiting requests into the batch, in queue order, while it has room (a request that
        does not fit whole under chunked prefill starts as the chunked request and ends it);
        the running requests preempted for them, their KV released, not queued again yet.
        ``running_bs`` is the running batch's size before the chunked request joined it."""
        p = self.params
        batch = room.batch
        preempted: list[SimRequest] = []
        while self.waiting:
            if p.max_running > 0 and running_bs + len(batch) >= p.max_running:
                self.batch_is_full = True
                if not preempting:
                    break
            request = self.waiting[0]
            if preempting and self.batch_is_full:
                victims = self._preempt_to_schedule(request, room.offset, batch)
                if not victims:
                    break
                preempted += victims
                running_bs -= len(victims)
                room.offset -= sum(self._clipped_left(r) * room.ratio for r in victims)
            cached_blocks = self._cached_prefix_blocks(request)
            extend = request.fill_tokens - cached_blocks * p.block_tokens
            need = extend + self._clipped_left(request)
            if need >= self._rem_total(request, room.offset):
                nothing_else = not self.running and not batch and self.chunked is None
                if not nothing_else:  # NO_TOKEN: batch full until a request leaves it
                    self.batch_is_full = True
                    break
                # a request larger than the idle pool would block the queue forever: run it alone
            if batch and extend >= room.rem_input:
                break
            if room.rem_chunk is not None and extend > room.rem_chunk:
                if room.rem_chunk <= 0:
                    break
                self._start(request, cached_blocks)
                self._allocate(request, room.rem_chunk)
                self.chunked = request
                batch.append(request)
                break
            self._start(request, cached_blocks)
            self._allocate(request, extend)
            self.running.append(request)
            batch.append(request)
            room.offset += need
            room.spend(extend)
        return preempted

    def _preempt_to_schedule(self, request: SimRequest, offset: float, batch: list[SimRequest]) -> list[SimRequest]:
        """SGLang's ``PrefillAdder.preempt_to_schedule`` for ``request``, met while the batch
        is full (:class:`~luftpause.fakes.priority.SglangPriority`): the running requests it
        preempts, their KV released at once (they join the queue after the batch); []
        when it preempts none. The batch stays full: each further request must preempt too."""
        assert isinstance(self.priority, SglangPriority)
        extend = request.fill_tokens - self._cached_prefix_blocks(request) * self.params.block_tokens
        lacking = extend + self._clipped_left(request) - self._rem_total(request, offset)
        in_batch = {id(r) for r in batch}
        running = [r for r in self.running if id(r) not in in_batch]
        victims = self.priority.victims(request, running, lacking,
                                        lambda r: self._clipped_left(r) * self.new_token_ratio)
        for victim in victims:
            self._send_back(victim)
        if victims:
            self.batch_is_full = True
        return victims

    def _start(self, request: SimRequest, cached_blocks: int) -> None:
        """Take the request off the queue, locking its cached prefix."""
        self.waiting.popleft()
        request.state = "running"
        request.held_blocks = list(request.hashes[:cached_blocks])
        self.cache.acquire(request.held_blocks)
        request.computed = cached_blocks * self.params.block_tokens
        request.private_tokens = 0
        request.prefix_hit = True
        if not request.admitted_once:
            request.admitted_once = True
            request.cached_tokens = min(request.computed, max(0, request.prompt_tokens - 1))
            self.counters.prompt_tokens += request.prompt_tokens
            self.counters.cached_tokens += request.cached_tokens

    def _allocate(self, request: SimRequest, extend: int) -> None:
        """KV for this pass's new tokens, evicting unused cache if needed."""
        self._evict_for(extend, request.held_blocks)
        request.extend_tokens = extend
        request.private_tokens += extend

    def prefill_ms(self, admitted: Sequence[SimRequest]) -> float:
        p = self.params
        return p.prefill_base_ms + p.prefill_ms_per_token * sum(r.extend_tokens for r in admitted)

    def _settle_blocks(self, request: SimRequest) -> None:
        """The computed prompt's full blocks go into the cache (``cache_unfinished_req``);
        a block another request cached meanwhile is shared, the private copy freed."""
        full = min(len(request.hashes), min(request.computed, request.prompt_tokens) // self.params.block_tokens)
        new = request.hashes[len(request.held_blocks):full]
        if new:
            self.cache.acquire(new)
            request.held_blocks.extend(new)
            request.private_tokens -= len(new) * self.params.block_tokens

    def finish_prefill(self, admitted: Iterable[SimRequest]) -> list[SimRequest]:
        """The prefill pass is over: complete prompts get their next token (the first, or
        the next after a retraction) and join the decode batch; returns those finished."""
        done = []
        for request in admitted:
            if request.state != "running":
                continue
            request.computed += request.extend_tokens
            request.extend_tokens = 0
            request.prefix_hit = False
            self._settle_blocks(request)
            if request is self.chunked:
                continue
            request.prefilled = True
            if request.generated < request.reply_tokens:
                request.generated += 1
            if request.done:
                self._finish(request)
                done.append(request)
        self.refresh_gauges()
        return done

    def decoding(self) -> list[SimRequest]:
        return [r for r in self.running if r.prefilled]

    def prepare_decode(self) -> list[SimRequest]:
        """``update_running_batch``: make room for one token per request, evicting cache,
        then retracting; otherwise decay ``new_token_ratio``. Returns the decode batch."""
        batch = self.decoding()
        self._evict_for(len(batch))
        if batch and self.free_tokens < len(batch):
            if isinstance(self.priority, VllmPriority):
                self._preempt_lowest_priority(batch)
            else:
                self._retract(batch)
            batch = self.decoding()
            self._evict_for(len(batch))
        else:
            p = self.params
            self.new_token_ratio = max(self.new_token_ratio - p.new_token_ratio_decay, p.min_new_token_ratio)
        self._decode_batch = batch
        return batch

    def _retract(self, batch: list[SimRequest]) -> None:
        """``retract_decode``: requeue the requests with the fewest generated tokens (then
        the longest prompts) until 20 tokens per remaining request are free."""
        p = self.params
        order = sorted(batch, key=lambda r: (r.generated, -r.prompt_tokens), reverse=True)
        first = True
        while first or self.free_tokens < len(order) * p.retract_decode_steps:
            if len(order) == 1:
                break
            first = False
            request = order.pop()
            self._send_back(request)
            self._enqueue(request)
            self._evict_for(len(order) * p.retract_decode_steps)
        self._reestimate_ratio(order)

    def _preempt_lowest_priority(self, batch: list[SimRequest]) -> None:
        """vLLM's priority preemption (:class:`~luftpause.fakes.priority.VllmPriority`): the
        running request of the lowest priority (largest value), latest arrived among equals,
        goes back to the queue until one token per remaining request fits. The admission
        that follows is still SGLang's, so ``new_token_ratio`` is re-estimated as after a
        retraction."""
        assert isinstance(self.priority, VllmPriority)
        order = list(batch)
        while len(order) > 1 and self.free_tokens < len(order):
            victim = self.priority.victim(order)
            order = [r for r in order if r is not victim]
            self._send_back(victim)
            self._enqueue(victim)
            self._evict_for(len(order))
        self._reestimate_ratio(order)

    def _send_back(self, request: SimRequest) -> None:
        """Out of the batch and back to waiting, its KV freed (its prompt blocks stay
        cached); its output so far is recomputed when it is admitted again."""
        self._release(request)
        request.state = "waiting"
        request.prefilled = False
        request.computed = 0
        request.retractions += 1
        self.counters.retractions += 1

    def _reestimate_ratio(self, order: list[SimRequest]) -> None:
        p = self.params
        decoded = sum(r.generated for r in order)
        planned = sum(r.max_new_tokens for r in order)
        self.new_token_ratio = min(1.0, (decoded + p.retract_decode_steps * len(order)) / (planned + 1))

    def decode_ms(self) -> float:
        p = self.params
        size = len(self._decode_batch) if self._decode_batch is not None else len(self.decoding())
        eager = p.decode_eager_ms if p.cuda_graph_max_bs > 0 and size > p.cuda_graph_max_bs else 0.0
        return p.decode_base_ms + p.decode_ms_per_request * size + eager

    def decode_step(self) -> list[SimRequest]:
        """Every request of the decode batch gets one token; returns those that finished."""
        batch = self._decode_batch if self._decode_batch is not None else self.prepare_decode()
        self._decode_batch = None
        self.counters.decode_steps += 1
        finished = []
        for request in batch:
            if request.state != "running":
                continue
            request.generated += 1
            request.private_tokens += 1
            request.computed += 1
            if request.done:
                finished.append(request)
        for request in finished:
            self._finish(request)
        if self.decode_logged():
            self.refresh_gauges()
        return finished

    def decode_logged(self) -> bool:
        """Whether the decode step just taken was one at which SGLang logs its decode stats
        (and refreshes its gauges): every ``metrics_interval_steps``."""
        interval = self.params.metrics_interval_steps
        return interval <= 1 or self.counters.decode_steps % interval == 0

    def _release(self, request: SimRequest) -> None:
        if request is self.chunked:
            self.chunked = None
        else:
            self.running.remove(request)
            self.batch_is_full = False  # the batch shrank: admission may go on
        request.private_tokens = 0
        self.cache.release(request.held_blocks)
        request.held_blocks = []
        if not self.busy:  # idle: the scheduler starts over with the initial ratio
            self.new_token_ratio = self.params.init_new_token_ratio

    def _finish(self, request: SimRequest) -> None:
        """Leave the batch; prompt and reply stay cached (for the run's next turn)."""
        self._release(request)
        request.state = "finished"
        self.counters.finished += 1
        full = block_hashes(request.prompt_text + request.reply_text, self.params.block_chars)
        new = full[len(request.hashes):]
        free_blocks = self.free_tokens // self.params.block_tokens
        if len(new) > free_blocks:
            self.counters.evicted_blocks += self.cache.evict(len(new) - free_blocks)
            free_blocks = self.free_tokens // self.params.block_tokens
        new = new[: max(0, free_blocks)]
        if new:
            self.cache.acquire(new)
            self.cache.release(new)
        if self.sessions is not None and request.session_id is not None:
            self.sessions.register(request.session_id, request.session_generation,
                                   full[: self.cache.cached_prefix(full)])

    def abort(self, request: SimRequest) -> None:
        """The client went away: free its place and its KV at once."""
        if request.state == "waiting":
            self.waiting.remove(request)
        elif request.state == "running":
            self._release(request)
        else:
            return
        request.state = "aborted"
        self.counters.aborted += 1

    def queued_for(self, model: str) -> int:
        return sum(1 for r in self.waiting if r.model == model)

    def running_for(self, model: str) -> int:
        return sum(1 for r in self.running if r.model == model)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.chunked is not None)
