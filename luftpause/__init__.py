"""luftpause: an agent-aware runtime and scheduler for LLM inference pools.

Subpackages: ``scheduler`` (decision core + gRPC host), ``dataplane`` (OpenAI-compatible
streaming proxy), ``runtime`` (MCP server running sub-agents), ``proto`` (the gRPC
contract), ``fakes`` (fake engine and fake MCP tools), ``loadgen`` (load and benchmarks).
"""

__version__ = "0.1.0"
