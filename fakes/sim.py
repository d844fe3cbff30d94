"""A continuously batching engine, as a model without clocks or I/O.

The fake engine's timing comes from here. The model follows what SGLang (and, in the
same spirit, vLLM) do on one GPU:

- **Running batch and waiting queue.** At most ``max_running`` requests generate at
  once; the rest wait first-come-first-served. The head of the queue blocks the
  queue: a later request is not admitted ahead of one that does not fit yet.
- **KV budget in tokens.** A request is admitted only when its uncached prompt plus
  its full reply reservation (``max_tokens``, else what is left of the context) fit
  into the KV pool, as SGLang reserves for the longest possible reply.
- **Prefix cache.** Prompts are tokenised at ~4 characters per token and hashed in
  fixed blocks, each hash chained to the one before; a request's cached prefix is the
  run of its leading blocks already in the pool. A finished request leaves its
  prompt and reply blocks cached; cached blocks are evicted least recently used when
  space is needed, never while a running request uses them.
- **Costs.** A prefill pass costs ``prefill_base_ms + prefill_ms_per_token ×
  uncached tokens`` and stalls decoding (SGLang runs prefill and decode batches in
  turn); one decode step costs ``decode_base_ms + decode_ms_per_request × batch``
  and gives every running request one token.

:class:`EngineModel` is driven by a loop (see ``engine.py``): ``admit`` then either
``prefill_ms`` of the admitted or one ``decode_step``; durations are in model
milliseconds, which the driver multiplies by the time scale.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class ModelParams:
    """The physical knobs of one replica (see the module doc for what each costs)."""

    max_running: int = 0  # 0 = no limit on the batch (KV still limits it)
    kv_tokens: int = 65536
    block_tokens: int = 16
    context_tokens: int = 8192  # reply reservation when a request sets no max_tokens
    max_prefill_tokens: int = 16384  # uncached tokens one prefill pass takes at most
    prefill_base_ms: float = 20.0
    prefill_ms_per_token: float = 0.0
    decode_base_ms: float = 2.0
    decode_ms_per_request: float = 0.0

    @property
    def block_chars(self) -> int:
        return self.block_tokens * CHARS_PER_TOKEN


def tokens_for_chars(chars: int) -> int:
    return max(1, -(-chars // CHARS_PER_TOKEN))


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """Chained hashes of the text's full blocks: equal lists mean equal prefixes."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start : start + block_chars].encode(), digest_size=12).digest()
        hashes.append(previous)
    return hashes


class PrefixCache:
    """Blocks in the KV pool by hash, with users counted and LRU order for eviction.

    A block is in ``_free`` (ordered oldest first) exactly when no running request
    uses it, so eviction takes from the front and never touches a used block.
    """

    def __init__(self) -> None:
        self._users: dict[bytes, int] = {}
        self._free: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._users)

    @property
    def evictable(self) -> int:
        return len(self._free)

    def __contains__(self, block: bytes) -> bool:
        return block in self._users

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks are present."""
        for count, block in enumerate(hashes):
            if block not in self._users:
                return count
        return len(hashes)

    def acquire(self, hashes: Iterable[bytes]) -> int:
        """Mark blocks used (adding missing ones); returns how many were added."""
        added = 0
        for block in hashes:
            users = self._users.get(block)
            if users is None:
                added += 1
                self._users[block] = 1
            else:
                self._users[block] = users + 1
                self._free.pop(block, None)
        return added

    def release(self, hashes: Iterable[bytes]) -> None:
        """Drop one use of each block; unused blocks become evictable, newest last.

        Released in reverse so a prompt's later blocks are older in LRU order than its
        first ones: the tail of a prefix goes before its head, as in a radix tree.
        """
        for block in reversed(list(hashes)):
            users = self._users.get(block)
            if users is None:
                continue
            if users <= 1:
                self._users[block] = 0
                self._free[block] = None
                self._free.move_to_end(block)
            else:
                self._users[block] = users - 1

    def evict(self, blocks: int) -> int:
        """Evict up to ``blocks`` unused blocks, least recently used first."""
        evicted = 0
        while evicted < blocks and self._free:
            block, _ = self._free.popitem(last=False)
            del self._users[block]
            evicted += 1
        return evicted


@dataclass
class SimRequest:
    """One request in the model: what it needs and how far it got."""

    id: int
    model: str
    prompt_text: str
    prompt_tokens: int
    reply_tokens: int  # tokens it will generate (its planned reply, already capped)
    reserve_tokens: int  # reply reservation held in the KV pool while running
    reply_text: str = ""  # cached after the prompt once finished (the next turn's prefix)
    hashes: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0
    generated: int = 0
    state: str = "new"  # new → waiting → running → finished | aborted
    prefilled: bool = False
    held_blocks: list[bytes] = field(default_factory=list)

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

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
    prefill_passes: int = 0
    decode_steps: int = 0


class EngineModel:
    """The batch, the queue and the KV pool of one replica."""

    def __init__(self, params: ModelParams) -> None:
        self.params = params
        self.cache = PrefixCache()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counters = Counters()
        self._next_id = 0
        # Tokens held outside shared blocks: partial prompt tails and reply reservations.
        self._private_tokens = 0

    # --- accounting --------------------------------------------------------------------

    def _private_need(self, request: SimRequest) -> int:
        tail = request.prompt_tokens - len(request.hashes) * self.params.block_tokens
        return max(0, tail) + request.reserve_tokens

    @property
    def used_tokens(self) -> int:
        """KV tokens in use by running requests (evictable cached blocks excluded)."""
        in_use = (len(self.cache) - self.cache.evictable) * self.params.block_tokens
        return in_use + self._private_tokens

    @property
    def pool_tokens(self) -> int:
        """KV tokens taken, evictable cache included."""
        return len(self.cache) * self.params.block_tokens + self._private_tokens

    def token_usage(self) -> float:
        return min(1.0, self.used_tokens / self.params.kv_tokens) if self.params.kv_tokens > 0 else 0.0

    def cache_hit_rate(self) -> float:
        c = self.counters
        return c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0

    # --- lifecycle -----------------------------------------------------------------------

    def submit(self, model: str, prompt_text: str, reply_tokens: int, max_tokens: int | None,
               reply_text: str = "") -> SimRequest:
        """Queue a request; ``reply_tokens`` is its planned length (≤ ``max_tokens``)."""
        prompt_tokens = tokens_for_chars(len(prompt_text))
        if self.params.context_tokens > 0:  # a reply can never outgrow the context
            left = max(1, self.params.context_tokens - prompt_tokens)
            reserve = min(max_tokens, left) if max_tokens is not None else left
        else:  # no context limit modelled: without max_tokens only the planned reply is held
            reserve = max_tokens if max_tokens is not None else reply_tokens
        request = SimRequest(
            id=self._next_id, model=model, prompt_text=prompt_text, prompt_tokens=prompt_tokens,
            reply_tokens=max(0, reply_tokens), reserve_tokens=max(reserve, reply_tokens), reply_text=reply_text,
            hashes=block_hashes(prompt_text, self.params.block_chars),
        )
        self._next_id += 1
        request.state = "waiting"
        self.waiting.append(request)
        return request

    def _fits(self, request: SimRequest) -> bool:
        """Whether the request fits now, evicting unused cached blocks if that helps."""
        cached_blocks = self.cache.cached_prefix(request.hashes)
        new_blocks = len(request.hashes) - cached_blocks
        need = new_blocks * self.params.block_tokens + self._private_need(request)
        free = self.params.kv_tokens - self.pool_tokens
        if need <= free:
            return True
        # Evictable blocks this request would reuse do not count as reclaimable.
        reusable = sum(1 for b in request.hashes[:cached_blocks] if self.cache._users.get(b) == 0)
        reclaimable = (self.cache.evictable - reusable) * self.params.block_tokens
        if need > free + reclaimable:
            return False
        # Protect the request's own prefix while evicting for it.
        self.cache.acquire(request.hashes[:cached_blocks])
        shortfall = need - free
        evicted = self.cache.evict(-(-shortfall // self.params.block_tokens))
        self.counters.evicted_blocks += evicted
        self.cache.release(request.hashes[:cached_blocks])
        return need <= self.params.kv_tokens - self.pool_tokens

    def admit(self) -> list[SimRequest]:
        """Move requests from the head of the queue into the batch while they fit.

        Returns the admitted ones, which need a prefill pass (their prefix hits are
        counted now). A single request larger than the whole pool never fits and would
        block the queue forever; it is admitted alone when the batch is empty.
        """
        admitted: list[SimRequest] = []
        prefill_tokens = 0
        p = self.params
        while self.waiting:
            if p.max_running > 0 and len(self.running) >= p.max_running:
                break
            head = self.waiting[0]
            cached_blocks = self.cache.cached_prefix(head.hashes)
            uncached = head.prompt_tokens - cached_blocks * p.block_tokens
            if admitted and prefill_tokens + uncached > p.max_prefill_tokens:
                break
            if not self._fits(head) and (self.running or admitted):
                break
            self.waiting.popleft()
            cached_blocks = self.cache.cached_prefix(head.hashes)  # eviction may have shortened it
            head.cached_tokens = min(cached_blocks * p.block_tokens, max(0, head.prompt_tokens - 1))
            self.cache.acquire(head.hashes)
            head.held_blocks = list(head.hashes)
            self._private_tokens += self._private_need(head)
            head.state = "running"
            self.running.append(head)
            admitted.append(head)
            prefill_tokens += head.uncached_tokens
            self.counters.prompt_tokens += head.prompt_tokens
            self.counters.cached_tokens += head.cached_tokens
        return admitted

    def prefill_ms(self, admitted: Sequence[SimRequest]) -> float:
        p = self.params
        return p.prefill_base_ms + p.prefill_ms_per_token * sum(r.uncached_tokens for r in admitted)

    def finish_prefill(self, admitted: Iterable[SimRequest]) -> list[SimRequest]:
        """The prefill pass is over: each request has its first token; requests with
        nothing more to generate are finished."""
        self.counters.prefill_passes += 1
        done = []
        for request in admitted:
            if request.state == "running":
                request.prefilled = True
                request.generated = min(1, request.reply_tokens)  # a prefill pass yields the first token
                if request.done:
                    self._finish(request)
                    done.append(request)
        return done

    def decoding(self) -> list[SimRequest]:
        return [r for r in self.running if r.prefilled]

    def decode_ms(self) -> float:
        p = self.params
        return p.decode_base_ms + p.decode_ms_per_request * len(self.decoding())

    def decode_step(self) -> list[SimRequest]:
        """Every prefilled running request gets one token; returns those that finished."""
        self.counters.decode_steps += 1
        finished = []
        for request in self.decoding():
            request.generated += 1
            if request.done:
                finished.append(request)
        for request in finished:
            self._finish(request)
        return finished

    def _release(self, request: SimRequest) -> None:
        self.running.remove(request)
        self._private_tokens -= self._private_need(request)
        self.cache.release(request.held_blocks)
        request.held_blocks = []

    def _finish(self, request: SimRequest) -> None:
        """Leave the batch; prompt and reply stay cached (for the run's next turn)."""
        self._release(request)
        request.state = "finished"
        self.counters.finished += 1
        full = block_hashes(request.prompt_text + request.reply_text, self.params.block_chars)
        new = full[len(request.hashes):]
        free_blocks = (self.params.kv_tokens - self.pool_tokens) // self.params.block_tokens
        if len(new) > free_blocks:
            self.counters.evicted_blocks += self.cache.evict(len(new) - free_blocks)
            free_blocks = (self.params.kv_tokens - self.pool_tokens) // self.params.block_tokens
        new = new[: max(0, free_blocks)]
        if new:
            self.cache.acquire(new)
            self.cache.release(new)

    def abort(self, request: SimRequest) -> None:
        """The client went away: free its place, its blocks and its reservation at once."""
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
        return bool(self.waiting or self.running)
