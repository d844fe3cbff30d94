"""luftpause runtime: an MCP server that runs sub-agents (SPEC §4).

Modules, outside in:

- ``__main__``: command line, logging, uvicorn.
- ``app``: the ASGI app (``/mcp``, ``GET /status``, ``GET /health``), bearer-token guard,
  start-up and shutdown.
- ``mcp_server``: the MCP tools (spawn, await, run, status, cancel, tools) and their errors.
- ``service``: ``Runtime``, which spawns runs as asyncio tasks, waits for and cancels them.
- ``agent``: the sub-agent loop (turn, tool-call round, next turn).
- ``dataplane``: LLM turns, run-end notices and the default model, over HTTP.
- ``upstream``: long-lived clients of the upstream MCP tool servers, routing by tool name.
- ``toolcalls``: argument coercion/validation and recovery of tool calls written as text.
- ``journal``: ``runs.jsonl``, replayed at start-up so runs survive restarts.
- ``runs``: the run model and the run tree; ``config``: settings and the tools file;
  ``constants``: the numbers from SPEC §8.
"""
