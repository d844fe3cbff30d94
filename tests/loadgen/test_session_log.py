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
    served, scale, _ = session_log.read(engine_log())
    assert scale == 0.5 and [s.session for s in served] == ["s1", "s2", "s1", "s2", "s1"]  # no batch line
    summary = session_log.summary(served, scale, every_s=1.0)
    assert summary["sessions"] == 2 and summary["moves"] == 1
    assert summary["lost"] == {"<2 s": [0, 1], "2-5 s": [1, 1], "5-10 s": [0, 0], ">=10 s": [1, 1]}


def test_pools_give_the_share_of_moments_by_how_the_sessions_split_over_replicas():
    served, scale, _ = session_log.read(engine_log())
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
    assert kept["summary"] == json.loads(first) and len(kept["engine_log"]) == 6  # the batch line left out
