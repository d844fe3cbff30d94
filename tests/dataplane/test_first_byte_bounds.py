"""The first-byte bound follows what the engine is doing: its recent first bytes, the
prompt and the prompts waiting there ahead of the turn; never one fixed number."""

from __future__ import annotations

from manual_clock import ManualClock


from luftpause.dataplane.constants import (
    FIRST_BYTE_FLOOR_S_PER_TOKEN,
    FIRST_BYTE_MARGIN,
    FIRST_BYTE_MIN_S,
    FIRST_BYTE_OWN_RATES,
    REPLY_TOKENS_WITHOUT_MAX,
    SILENT_BOUND_SHARE,
    SILENT_MIN_S,
)
from luftpause.dataplane.timing import FirstByteBounds, Watch, Watchdog, prompt_tokens


def answered(bounds: FirstByteBounds, replica: str, tokens: int, seconds: float, stream: bool = True) -> None:
    watch = bounds.start(replica, stream, tokens, 0.0)
    bounds.first_byte(watch, seconds)
    bounds.ended(watch)


def test_a_cold_pool_gets_a_generous_bound_that_tightens_with_the_first_answers():
    bounds = FirstByteBounds()
    waiting = bounds.start("b", True, 500, 0.0)
    cold = bounds.bound(waiting)
    assert cold > 10  # nothing known: as slow as a CPU engine's prefill
    answered(bounds, "a", 500, 0.05)  # a peer answers quickly: the pool's history applies to b
    assert bounds.bound(waiting) == FIRST_BYTE_MIN_S


def test_a_slow_replica_gets_a_proportionally_longer_bound_than_a_fast_one():
    bounds = FirstByteBounds()
    for _ in range(5):
        answered(bounds, "fast", 2000, 1.0)
        answered(bounds, "slow", 2000, 10.0)
    fast = bounds.bound(bounds.start("fast", True, 2000, 0.0))
    slow = bounds.bound(bounds.start("slow", True, 2000, 0.0))
    assert fast > FIRST_BYTE_MIN_S and abs(slow / fast - 10) < 0.01


def test_prompts_waiting_there_and_a_longer_prompt_lengthen_the_bound():
    bounds = FirstByteBounds()
    answered(bounds, "a", 1000, 1.0)
    alone = bounds.bound(Watch("a", True, 1000, 0, 0.0))  # with nothing else waiting there
    first = bounds.start("a", True, 1000, 0.0)
    assert bounds.bound(first) == alone
    second = bounds.start("a", True, 1000, 0.0)  # prefilled after the first, or with it
    assert bounds.bound(second) > alone and bounds.bound(first) == bounds.bound(second)
    for watch in (first, second):
        bounds.ended(watch)
    longer = bounds.start("a", True, 8000, 0.0)
    assert bounds.bound(longer) > 4 * alone
    bounds.ended(longer)
    assert bounds.bound(bounds.start("a", True, 1000, 0.0)) == alone  # nothing waits any more


def test_a_long_prompt_is_never_bounded_below_its_uncached_prefill():
    bounds = FirstByteBounds()
    answered(bounds, "a", 100_000, 0.1)  # a cached prefix: quick however long
    watch = bounds.start("a", True, 100_000, 0.0)
    assert bounds.bound(watch) >= 100_000 * FIRST_BYTE_FLOOR_S_PER_TOKEN


def test_streams_and_whole_replies_learn_apart_once_each_has_rates_of_its_own():
    bounds = FirstByteBounds()
    for _ in range(FIRST_BYTE_OWN_RATES):
        answered(bounds, "a", 500, 0.05, stream=True)
    answered(bounds, "a", 500, 8.0, stream=False)  # a whole reply's first byte comes with its end
    assert bounds.bound(bounds.start("a", True, 500, 0.0)) == FIRST_BYTE_MIN_S
    assert bounds.bound(bounds.start("a", False, 500, 0.0)) >= 4 * 8.0


def test_one_quick_stream_does_not_tighten_a_replicas_bound_below_the_slower_turns_seen_there():
    """A replica's whole replies took 3 s for 1,000 tokens of work (uncached prompts, as on a
    CPU engine); a stream whose prefix was cached gives its first token in 0.1 s. The next
    stream (its prefix gone, say) is not held to the least bound on that one quick answer:
    until streams have FIRST_BYTE_OWN_RATES answers of their own there, the whole replies'
    rate counts too."""
    bounds = FirstByteBounds()
    for _ in range(3):
        answered(bounds, "a", 1000 - 256, 3.0, stream=False)  # 3 s per 1,000 tokens of work with the overhead
    answered(bounds, "a", 1000 - 256, 0.1, stream=True)
    slow_rate = 3.0 / 1000
    assert bounds.bound(bounds.start("a", True, 1000 - 256, 0.0)) >= FIRST_BYTE_MARGIN * slow_rate * 1000 > 10
    for _ in range(FIRST_BYTE_OWN_RATES - 1):
        answered(bounds, "a", 1000 - 256, 0.1, stream=True)
    assert bounds.bound(bounds.start("a", True, 1000 - 256, 0.0)) == FIRST_BYTE_MIN_S  # streams' own now


def test_the_other_kinds_rates_never_tighten_a_bound():
    """Quick whole replies (their reply tokens weighed in) on a replica with no stream
    answered anywhere: a stream there keeps the cold bound, not the whole replies' pace."""
    bounds = FirstByteBounds()
    first = bounds.start("a", True, 600, 0.0)
    cold = bounds.bound(first)
    bounds.ended(first)
    for _ in range(3):
        answered(bounds, "a", 600, 0.5, stream=False)
    assert bounds.bound(bounds.start("a", True, 600, 0.0)) == cold > 10


def test_a_streams_pause_may_last_while_the_engine_prefills_the_prompts_sent_there_after_it():
    """An engine prefilling new prompts pauses the streams it is decoding (llama.cpp and
    SGLang run a prefill batch before the next decode step): an answered stream's pause
    bound counts the prompts waiting there now, not only those ahead of it when it was sent."""
    bounds = FirstByteBounds()
    for _ in range(FIRST_BYTE_OWN_RATES):
        answered(bounds, "a", 500, 1.0, stream=True)
    stream = bounds.start("a", True, 500, 0.0)
    bounds.first_byte(stream, 1.0)
    alone = bounds.bound(stream)
    later = [bounds.start("a", True, 4000, 1.5) for _ in range(2)]  # sent after it, waiting for theirs
    assert bounds.bound(stream) > 8 * alone
    for watch in later:
        bounds.first_byte(watch, 5.0)
    assert bounds.bound(stream) == alone  # prefilled: its pauses are held to its own bound again


def test_a_waiting_turns_bound_counts_the_prompts_sent_there_after_it():
    """An engine prefills the prompts waiting together (llama.cpp's four slots in one pass
    on a CPU: four cold 600-token prompts gave their first tokens together after 12 s): the
    first turn sent waits with those sent after it."""
    bounds = FirstByteBounds()
    for _ in range(FIRST_BYTE_OWN_RATES):
        answered(bounds, "a", 600, 1.0, stream=True)
    first = bounds.start("a", True, 600, 0.0)
    alone = bounds.bound(first)
    later = [bounds.start("a", True, 600, 0.1) for _ in range(3)]
    assert bounds.bound(first) == bounds.bound(later[-1]) > 2.5 * alone
    for watch in later:
        bounds.ended(watch)
    assert bounds.bound(first) == alone


def test_prompt_tokens_are_estimated_from_the_body():
    assert prompt_tokens(b"x" * 4000) == 1000


def test_a_whole_reply_counts_its_reply_tokens_so_a_long_reply_after_short_ones_is_no_stall():
    """A non-streamed reply's first byte is its whole reply: after quick one-token
    answers, a 2,000-token reply on the same prompt may take far longer than they did."""
    from luftpause.dataplane.constants import FIRST_BYTE_REPLY_FLOOR_S_PER_TOKEN
    from luftpause.dataplane.timing import reply_tokens

    bounds = FirstByteBounds()
    for _ in range(5):  # one-token answers (a label's score, say) on a 1,000-token prompt: 0.1 s each
        watch = bounds.start("a", False, 1000, 0.0, *reply_tokens(b'{"max_tokens": 1}'))
        bounds.first_byte(watch, 0.1)
        bounds.ended(watch)
    short = bounds.bound(bounds.start("a", False, 1000, 0.0, 1, True))
    long = bounds.bound(bounds.start("a", False, 1000, 0.0, *reply_tokens(b'{"max_completion_tokens":2000}')))
    assert long >= 2000 * FIRST_BYTE_REPLY_FLOOR_S_PER_TOKEN > 10 * short
    # a turn queued behind two whole replies waits for them too
    queued = bounds.start("a", False, 1000, 0.0, 1, True)
    assert queued.pending > bounds.start("b", False, 1000, 0.0, 1, True).pending + 20000
    # a stream's first byte is its first token: no reply counted
    assert bounds.start("c", True, 1000, 0.0, 2000, True).work == 1000
    # no stated max_tokens: counted as a typical reply, with no floor (a wedge is still left quickly)
    assert reply_tokens(b'{"messages": []}') == (REPLY_TOKENS_WITHOUT_MAX, False)
    assert bounds.start("d", False, 10, 0.0, *reply_tokens(b'{"messages": []}')).floor == 0.0


# Silence: well before its bound, a turn whose replica has sent nothing since it was sent
# is reported once, so the scheduler places nothing new there; the turn goes on waiting.
# The watchdog runs on a clock the test moves (the durations are the point), not the wall's.


def test_a_turn_whose_replica_sends_nothing_is_reported_silent_once_well_before_its_bound():
    clock = ManualClock()
    bounds = FirstByteBounds()
    answered(bounds, "a", 500, 0.05)  # a quick peer: b's bound is the floor
    watch = bounds.start("b", True, 500, clock.time())
    assert bounds.bound(watch) == FIRST_BYTE_MIN_S
    reports: list[float] = []
    dog = Watchdog(bounds, watch, lambda: reports.append(clock.time()), loop=clock)
    try:
        clock.move_to(watch.started + SILENT_MIN_S - 0.01)
        assert reports == [] and not bounds.is_silent("b")
        clock.move_to(watch.started + SILENT_MIN_S)
        assert reports == [watch.started + SILENT_MIN_S]  # well before its bound
        assert bounds.is_silent("b") and not bounds.is_silent("a")
        assert not watch.stalled and not watch.answered  # it waits on: nothing re-sent
        clock.move_to(watch.started + FIRST_BYTE_MIN_S - 0.01)  # up to its bound
        assert len(reports) == 1  # once per turn
        bounds.heard("b", clock.time())  # a byte from b: it speaks
        assert not bounds.is_silent("b")
    finally:
        dog.cancel()


def test_a_replica_that_keeps_sending_bytes_is_not_silent_while_a_turn_waits_there():
    clock = ManualClock()
    bounds = FirstByteBounds()
    answered(bounds, "a", 500, 0.05)
    watch = bounds.start("a", True, 500, clock.time())
    reports: list[float] = []
    dog = Watchdog(bounds, watch, lambda: reports.append(clock.time()), loop=clock)
    try:
        for i in range(1, 13):  # another turn's stream there goes on: the engine is busy, not wedged
            clock.move_to(watch.started + i / 10)
            bounds.heard("a", clock.time())
        assert reports == [] and not bounds.is_silent("a")
        quiet_from = clock.time()  # then it goes quiet
        clock.move_to(quiet_from + SILENT_MIN_S - 0.01)
        assert reports == []
        clock.move_to(quiet_from + SILENT_MIN_S)
        assert reports == [quiet_from + SILENT_MIN_S]
    finally:
        dog.cancel()


def test_silence_waits_for_what_the_replicas_recent_rate_predicts_a_quarter_of_a_long_bound():
    bounds = FirstByteBounds()
    for _ in range(3):
        answered(bounds, "slow", 2000, 10.0)  # a slow replica: a long bound
    watch = bounds.start("slow", True, 2000, 0.0)
    assert bounds.bound(watch) > 4 * FIRST_BYTE_MIN_S
    assert bounds.silent_after(watch) == SILENT_BOUND_SHARE * bounds.bound(watch)
    quick = bounds.start("quick", True, 500, 0.0)
    answered(bounds, "quick", 500, 0.02)
    quick = bounds.start("quick", True, 500, 0.0)
    assert bounds.bound(quick) == FIRST_BYTE_MIN_S  # the bound's least value ...
    assert bounds.silent_after(quick) == SILENT_MIN_S < SILENT_BOUND_SHARE * FIRST_BYTE_MIN_S  # ... is not silence's
