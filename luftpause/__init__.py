"""luftpause: an agent-aware runtime and scheduler for LLM inference pools.

Subpackages: ``scheduler`` (decision core + gRPC host), ``dataplane`` (OpenAI-compatible
streaming proxy), ``picker`` (the endpoint picker behind Envoy), ``runtime`` (MCP server
running sub-agents), ``proto`` (the gRPC contract), ``fakes`` (fake engine and fake MCP
tools), ``loadgen`` (load and benchmarks), ``dev`` (the ``python -m luftpause`` launcher,
the local stack and the rest of the development tooling). The modules directly in
``luftpause/`` are the ones the services import at run time.
"""

__version__ = "0.1.0"
