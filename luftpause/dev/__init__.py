"""Development and benchmark tooling, never imported by a service at run time.

``launcher`` is ``python -m luftpause`` (``make run``): the whole stack as local processes;
``stack`` starts and stops that stack (the launcher, the end-to-end tests and the
benchmarks use it); ``supervise`` restarts the launcher's children that die; ``procs``
starts, waits for and stops one process, finds free ports and reads a process's memory
and CPU from ``/proc``; ``llama`` builds llama-server and fetches SmolLM2 for
``ENGINE=llama`` (``python -m luftpause.dev.llama build``); ``faultproxy`` is the TCP
proxy that cuts links in the partition tests and ``make chaos-load``.

The services' shared run-time modules stay in ``luftpause/`` itself (logs, auth, tokens,
origins, tracing, the gRPC environment, metric labels, peer identity, headers, the event
loop); tests/test_entry_points.py checks that no service entry point imports this package.
"""
