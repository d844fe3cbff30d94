"""Strict tool arguments for the runtime's MCP tools, whatever tool is registered.

The SDK builds each tool's argument model in pydantic's lax mode: ``"5"`` and ``true``
pass as integers, ``"yes"`` as a boolean, ``1e999`` and ``NaN`` as numbers, and unknown
arguments are dropped silently. A model that sends any of these has made a mistake it
should hear about, so every tool's model is made strict (JSON types only, finite
numbers, no unknown keys) and its input schema says ``additionalProperties: false``.
Type errors come back as a tool error naming the argument, as the SDK reports them.
"""

from __future__ import annotations

from typing import Any

from mcp import MCPError
from mcp.server.mcpserver import MCPServer
from mcp_types import INVALID_PARAMS
from pydantic import ConfigDict

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, arbitrary_types_allowed=True)


def tighten_arguments(server: MCPServer) -> None:
    """Make every tool registered on ``server`` so far validate its arguments strictly."""
    for tool in server._tool_manager.list_tools():  # noqa: SLF001 - the SDK has no public hook for this
        lax = tool.fn_metadata.arg_model
        tool.fn_metadata.arg_model = type(lax.__name__, (lax,), {"model_config": STRICT, "__module__": lax.__module__})
        tool.parameters["additionalProperties"] = False


def answer_unknown_prompts_with_invalid_params(server: MCPServer) -> None:
    """`prompts/get` of a prompt this server does not have is the client's mistake
    (-32602), not an error without a code (the SDK's ValueError becomes code 0)."""
    get_prompt = server.get_prompt

    async def checked_get_prompt(name: str, arguments: dict[str, Any] | None = None, context: Any = None) -> Any:
        if name not in {prompt.name for prompt in await server.list_prompts()}:
            raise MCPError(code=INVALID_PARAMS, message=f"unknown prompt: {name}")
        return await get_prompt(name, arguments, context)

    server.get_prompt = checked_get_prompt  # type: ignore[method-assign]

