"""The generated gRPC modules must match scheduler.proto (run `make proto`)."""

from luftpause.proto.generate import stale_modules


def test_generated_modules_match_the_proto():
    assert stale_modules() == []
