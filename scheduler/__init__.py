"""The scheduler: the pure decision core and its gRPC/HTTP host (``python -m luftpause.scheduler``)."""

from luftpause import grpc_env

grpc_env.choose_transport()  # before any module of this package imports grpc
