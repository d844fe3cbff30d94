"""luftpause runtime: an MCP server that runs sub-agents.

Modules, outside in:

- ``__main__``: command line, logging, uvicorn.
- ``app``: the ASGI app (``/mcp``, ``GET /status``, ``GET /health``), bearer-token guard,
  start-up and shutdown.
- ``mcp_server``: the MCP tools (spawn, await, run, status, cancel, tools, decide) and their errors.
- ``decide``: classification by a one-pass replica, or by scoring caller labels.
- ``service``: ``Runtime``, which spawns runs as asyncio tasks, waits for and cancels them.
- ``agent``: the sub-agent loop (turn, tool-call round, next turn).
- ``budgets``: token, tool-call and seconds limits over a run's subtree.
- ``dataplane``: LLM turns, run-end notices and the default model, over HTTP.
- ``upstream``: long-lived clients of the upstream MCP tool servers, routing by tool name.
- ``toolcalls``: argument coercion/validation and recovery of tool calls written as text.
- ``journal``: ``runs.jsonl``, replayed at start-up so runs survive restarts.
- ``runs``: the run model and the run tree; ``config``: settings and the tools file;
  ``constants``: the numbers, each with its reason.

Seams left for later features:

- Tool approval: ``AgentLoop(approval_gate=...)`` is asked before each call
  (False = the model reads ``DECLINED_TEXT``); ``RunStatus.AWAITING_APPROVAL`` and the
  ``pendingApproval`` field of await/status records exist; ``spawn(approveTools)`` is
  stored in the spec and journal; replay skips record kinds it does not know, so
  approval decisions can be journaled as a new kind.
- MCP Tasks: the ``run`` tool waits on ``run.finished``; a Tasks extension
  would return a task there instead and journal it beside ``runs.jsonl``.
"""
