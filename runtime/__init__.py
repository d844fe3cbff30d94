"""luftpause runtime: an MCP server that runs sub-agents.

Modules, outside in:

- ``__main__``: command line, logging, uvicorn.
- ``http_protocol``: uvicorn's h11 protocol, answering a request it cannot read in JSON.
- ``app``: the ASGI app (``/mcp``, ``GET /status``, ``GET /health``), bearer-token guard,
  start-up and shutdown.
- ``mcp_server``: the MCP tools (spawn, await, run, status, cancel, approve, tools, decide) and their errors.
- ``principals``: who is asking: a tenant key's caller (its own runs only), else the
  caller header or an opaque name for the MCP session.
- ``tasks``: the MCP Tasks extension (`run` as a task, ``tasks.jsonl``).
- ``asking``: asking the human about approvals through the waiting client (elicitation,
  input-required results).
- ``decide``: classification by a one-pass replica, or by scoring caller labels.
- ``service``: ``Runtime``, which spawns runs as asyncio tasks, waits for and cancels them.
- ``agent``: the sub-agent loop (turn, tool-call round, next turn).
- ``approvals``: which tool calls wait for a human, their answers and journal records.
- ``budgets``: token, tool-call and seconds limits over a run's subtree.
- ``dataplane``: LLM turns, run-end notices and the default model, over HTTP.
- ``upstream``: long-lived clients of the upstream MCP tool servers, routing by tool name.
- ``toolcalls``: argument coercion/validation and recovery of tool calls written as text.
- ``journal``: ``runs.jsonl``, replayed at start-up so runs survive restarts.
- ``compaction``: the journal's atomic rewrite and the retention of finished runs.
- ``runs``: the run model and the run tree; ``config``: settings and the tools file;
  ``constants``: the numbers, each with its reason.
"""
