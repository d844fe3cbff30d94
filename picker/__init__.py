"""The endpoint picker (``python -m luftpause.picker``): luftpause's scheduler behind
Envoy, over ext_proc, the second front door beside the dataplane. To the scheduler it is
one more dataplane; what it shares with the dataplane (the Connect stream, the run book,
the request checks, the reply's observer) is in ``luftpause/``, not imported from it."""

from luftpause import grpc_env

grpc_env.choose_transport()  # before any module of this package imports grpc
