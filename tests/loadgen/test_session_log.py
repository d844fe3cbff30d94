"""loadgen/session_log.py: a fake engine's request log read by session: how the sessions
were spread over the replicas and which turns back from a tool pause lost their context."""

from __future__ import annotations

import gzip
import json
from datetime import datetime, timedelta, timezone

from luftpause.loadgen import session_log

T0 = datetime(2026, 12, 6, 4, 0, 0, tzinfo=timezone.utc)


def stamp(wall_s: float) -> str:
    return (T0 + timedelta(seconds=wall_s)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def done(end_s: float, duration_s: float, replica: str, session: str | None, prompt: int, cached: int) -> str:
    return (f"{stamp(end_s)} [info     ] chat.done                      cached_tokens={cached} completion_tokens=20 "
            f"duration_s={duration_s} engine=engine finish_reason=tool_calls id=x priority=2 "
            f"prompt_tokens={prompt} replica={replica} service=fake-engine session_id={session}")


def engine_log() -> list[str]:
    """At time scale 0.5: session s1 on engine-0 back from a 1 s pause with its context and
    from a 12 s pause without; s2 on engine-1, then moved to engine-0 after 3 s and lost
    there; a batch request (no session) between."""
    return [
        f"{stamp(0)} [info     ] engine_start                   engine=engine time_scale=0.5 tool_calls=64",
        done(1.0, 1.0, "engine-0", "s1", 1000, 0),
        done(1.0, 1.0, "engine-1", "s2", 1000, 0),
        done(2.0, 0.5, "engine-0", "s1", 1200, 1000),  # started 1.5: 0.5 wall = 1 model second after
        done(2.2, 0.2, "engine-1", None, 5000, 0),
        done(3.0, 0.5, "engine-0", "s2", 1300, 100),  # started 2.5: 3 model seconds after
        done(9.0, 1.0, "engine-0", "s1", 1500, 100),  # started 8.0: 12 model seconds after
    ]


def test_turns_back_from_a_pause_are_binned_by_model_seconds_and_lost_below_half_cached():
    served, scale, kv_tokens, _ = session_log.read(engine_log())
    assert scale == 0.5 and kv_tokens == 0 and [s.session for s in served] == ["s1", "s2", "s1", "", "s2", "s1"]
    summary = session_log.summary(served, scale, every_s=1.0)
    assert summary["sessions"] == 2 and summary["moves"] == 1
    assert summary["lost"] == {"<2 s": [0, 1], "2-5 s": [1, 1], "5-10 s": [0, 0], ">=10 s": [1, 1]}


def test_pools_give_the_share_of_moments_by_how_the_sessions_split_over_replicas():
    served, scale, _, _ = session_log.read(engine_log())
    # s1 under way 0-9 s wall on engine-0, s2 0-3 s on engine-1 (its first replica): sampled
    # every 0.5 s wall, both are under way at 7 of 19 moments, s1 alone at the other 12
    assert session_log.summary(served, scale, every_s=1.0)["pools"] == {"1": round(12 / 19, 3),
                                                                        "1+1": round(7 / 19, 3)}


def test_since_skips_earlier_requests_but_keeps_the_engines_time_scale(tmp_path, capsys):
    log = tmp_path / "engine.log"
    log.write_text("\n".join(engine_log()) + "\n")
    assert session_log.main([str(log), "--since", stamp(2.5)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sessions"] == 2 and summary["lost"]["2-5 s"] == [0, 0]  # one request each: no pause
    assert session_log.main([str(log), "--since", stamp(10)]) == 1
    assert "no request with a session_id" in capsys.readouterr().err


def test_a_gzipped_log_and_an_archive_of_it_read_as_the_plain_one(tmp_path, capsys):
    plain, packed, archive = tmp_path / "engine.log", tmp_path / "engine.log.gz", tmp_path / "sessions.json.gz"
    plain.write_text("\n".join(engine_log()) + "\n")
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert session_log.main([str(plain), "--archive", str(archive)]) == 0
    assert session_log.main([str(packed)]) == 0 and session_log.main([str(archive)]) == 0
    first, second, third = capsys.readouterr().out.splitlines()
    assert first == second == third and json.loads(first)["lost"][">=10 s"] == [1, 1]
    kept = json.loads(gzip.decompress(archive.read_bytes()))
    assert kept["summary"] == json.loads(first) and len(kept["engine_log"]) == 7  # the batch line too


def causes_log() -> list[str]:
    """At time scale 1 with a 3,000-token pool: on engine-0, a and b hold 1,000 and 2,500
    tokens, over the pool; on engine-1, c (1,000) loses its context while a 2,500-token
    request without a session runs there alone, then while one runs beside another request,
    then while only a 1,500-token one does (room enough: a partial eviction); on engine-0
    again after b's end, a loses nothing it could not keep, and moved turns are not counted."""
    return [
        f"{stamp(0)} [info     ] engine_start                   engine=engine kv_tokens=3000 time_scale=1.0",
        done(1.0, 1.0, "engine-0", "a", 1000, 0),
        done(1.0, 1.0, "engine-1", "c", 1000, 0),
        done(1.5, 1.5, "engine-0", "b", 2500, 0),
        done(3.0, 1.0, "engine-1", None, 2500, 0),  # alone on engine-1 from 2.0
        done(5.0, 1.0, "engine-0", "a", 1100, 200),  # a back from a 3 s pause: 800 computed again
        done(5.5, 1.0, "engine-1", "c", 1100, 100),  # c back: 900 again
        done(7.0, 1.0, "engine-1", None, 400, 0),  # from 6.0, with the next one from 6.5
        done(8.0, 1.5, "engine-1", None, 2400, 0),
        done(9.0, 0.5, "engine-1", "c", 1200, 300),  # c back: 800 again
        done(10.5, 1.0, "engine-1", None, 1500, 0),
        done(11.5, 0.5, "engine-1", "c", 1300, 400),  # c back: 800 again
        done(12.0, 0.5, "engine-1", "b", 2600, 0),  # b moved: not counted
    ]


def test_causes_say_what_left_no_room_for_a_lost_context_and_the_tokens_computed_again(tmp_path, capsys):
    served, scale, kv_tokens, lines = session_log.read(causes_log())
    assert kv_tokens == 3000 and len(lines) == len(causes_log())
    assert session_log.summary(served, scale, 1.0, kv_tokens)["causes"] == {
        session_log.OVER_POOL: [1, 800],  # a: 1,000 + b's 2,500 > 3,000
        session_log.UNNAMED_ALONE: [1, 900],
        session_log.UNNAMED_BESIDE: [1, 800],
        session_log.OTHER: [1, 800],
    }
    log = tmp_path / "engine.log"
    log.write_text("\n".join(causes_log()) + "\n")
    assert session_log.main([str(log), "--until", stamp(5.2)]) == 0  # c's return stamped 5.5: left out
    assert json.loads(capsys.readouterr().out)["causes"] == {
        session_log.OVER_POOL: [1, 800], session_log.UNNAMED_ALONE: [0, 0],
        session_log.UNNAMED_BESIDE: [0, 0], session_log.OTHER: [0, 0]}


def test_without_the_pool_size_no_causes_are_given():
    served, scale, kv_tokens, _ = session_log.read(engine_log())
    assert session_log.summary(served, scale, 1.0, kv_tokens)["causes"] == {}
