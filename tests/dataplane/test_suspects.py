"""The memory of requests that took a replica down (dataplane/suspects.py); the turns
themselves are in tests/e2e/test_query_of_death.py."""

from __future__ import annotations

from luftpause.dataplane.suspects import Suspects, fingerprint


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_request_is_refused_once_it_took_two_replicas_down_and_only_while_remembered():
    clock = Clock()
    suspects = Suspects(memory_s=60, clock=clock)
    key = fingerprint("m", b'{"messages": []}')
    assert not suspects and not suspects.refused(key)
    assert suspects.failed_on(key, "engine-a") == {"engine-a"}
    assert not suspects.refused(key)  # one more send
    assert suspects.failed_on(key, "engine-a") == {"engine-a"}  # the same replica again is not two
    assert not suspects.refused(key)
    assert suspects.failed_on(key, "engine-b") == {"engine-a", "engine-b"}
    assert suspects.refused(key)
    clock.now += 59.9
    assert suspects.refused(key)
    clock.now += 0.2
    assert not suspects.refused(key) and suspects.replicas(key) == frozenset()


def test_the_fingerprint_is_the_model_and_the_exact_body():
    body = b'{"messages": [{"role": "user", "content": "x"}]}'
    assert fingerprint("m", body) == fingerprint("m", body)
    assert fingerprint("m", body) != fingerprint("n", body)
    assert fingerprint("m", body) != fingerprint("m", body + b" ")
    assert fingerprint("m", b"a") != fingerprint("ma", b"")  # the model ends where the body starts


def test_memory_is_bounded_the_oldest_going_first():
    suspects = Suspects(entries=3)
    keys = [fingerprint("m", str(i).encode()) for i in range(5)]
    for key in keys:
        suspects.failed_on(key, "engine-a")
        suspects.failed_on(key, "engine-b")
    assert [suspects.refused(k) for k in keys] == [False, False, True, True, True]


def test_re_sends_from_one_replica_share_one_lane():
    suspects = Suspects()
    assert suspects.lane("engine-a") is suspects.lane("engine-a")
    assert suspects.lane("engine-a") is not suspects.lane("engine-b")
