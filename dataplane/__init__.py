"""The dataplane: the OpenAI-compatible streaming proxy (``python -m luftpause.dataplane``)."""

from luftpause import grpc_env

grpc_env.choose_transport()  # before any module of this package imports grpc
