"""gRPC's transport in luftpause's own processes, chosen before ``grpc`` is imported.

grpcio reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is first imported. Since the 1.6x
releases its client channels and server listeners run on the EventEngine by default,
which under asyncio hands each message of a stream from gRPC's own threads to the event
loop. The transport before it does not. On the shape of the dataplane's Connect stream
to the scheduler (small messages both ways, one process on each side) the older one
costs about half the CPU per message on each side and half the round-trip time:
measured with grpcio 1.85 on this project's 2-core machines by the retired ``make bench-grpc``
(its script: ``git show 61668e5:loadgen/grpc_transport_bench.py``; the figures:
``git show 06d03a1:docs/benchmarks.md``, "gRPC's transport"). Both are gRPC's own, selected by its documented switch; the wire
protocol is the same, so either side may run either.

The scheduler's, the dataplane's and the endpoint picker's packages call
:func:`choose_transport` first thing.
A ``GRPC_EXPERIMENTS`` an operator has set is left as it is.
"""

from __future__ import annotations

import os
import sys

GRPC_EXPERIMENTS = "GRPC_EXPERIMENTS"
LEGACY_TRANSPORT = "-event_engine_client,-event_engine_listener"


def choose_transport() -> bool:
    """Prefer gRPC's pre-EventEngine client and listener in this process; False when it
    is too late (``grpc`` already imported) or an operator chose otherwise."""
    if "grpc" in sys.modules or GRPC_EXPERIMENTS in os.environ:
        return False
    os.environ[GRPC_EXPERIMENTS] = LEGACY_TRANSPORT
    return True

# Server option for luftpause's gRPC listeners. gRPC sets SO_REUSEPORT on Linux by default,
# so a second server on a port already served starts without an error and the kernel splits
# the connections between the two (a stale scheduler would silently take half the
# dataplanes). Without it a taken port is a "Failed to bind" at start, like every HTTP port.
EXCLUSIVE_PORT = (("grpc.so_reuseport", 0),)
