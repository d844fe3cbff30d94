"""Tool arguments for the runtime's MCP tools: strict, and every mistake in them answered
in one way.

The SDK builds each tool's argument model in pydantic's lax mode: ``"5"`` and ``true``
pass as integers, ``"yes"`` as a boolean, ``1e999`` and ``NaN`` as numbers, and unknown
arguments are dropped silently. A model that sends any of these has made a mistake it
should hear about, so every tool's model is made strict (JSON types only, finite
numbers, no unknown keys) and its input schema says ``additionalProperties: false``.

Every argument error — a wrong type, a value out of range, a handle that names no run, a
cap reached — is a tool execution error (a result with ``isError: true`` and a one-line
text naming the argument), as MCP 2025-11-25 prefers (SEP-1303): the client hands it to
its model, which can correct the call; a JSON-RPC error would stop at the client. So is a
tool name the server does not have (the SDK's "Unknown tool", which MCP's conformance
suite expects as a result). What is not about a tool call stays a JSON-RPC error: an
unknown prompt (-32602), a server that cannot keep its promises (-32603).
"""

from __future__ import annotations

from typing import Any

from mcp import MCPError
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool
from mcp_types import INVALID_PARAMS
from pydantic import ConfigDict, ValidationError

from luftpause.runtime.errors import RuntimeServiceError

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, arbitrary_types_allowed=True)


class ToolArgumentError(RuntimeServiceError, ToolError):
    """Raised by a tool for an argument the MCP client got wrong (a model's tool-call
    arguments are toolcalls.ToolCallArgumentsError); reaches the client as an
    ``isError`` result reading ``Error executing tool <name>: <message>``."""


def strict(tool: Tool) -> Tool:
    """``tool``, validating its arguments strictly; its input schema says so."""
    lax = tool.fn_metadata.arg_model
    tool.fn_metadata.arg_model = type(lax.__name__, (lax,), {"model_config": STRICT, "__module__": lax.__module__})
    tool.parameters["additionalProperties"] = False
    return tool


def validation_text(error: ValidationError) -> str:
    """One line per wrong argument, named as on the wire, without pydantic's model names,
    echoed values or documentation links."""
    problems = []
    for detail in error.errors(include_url=False, include_input=False):
        name = ".".join(str(part) for part in detail["loc"]) or "arguments"
        if detail["type"] == "extra_forbidden":
            problems.append(f"{name}: unknown argument")
        elif detail["type"] == "missing":
            problems.append(f"{name}: required")
        else:
            problems.append(f"{name}: {detail['msg']}")
    return "invalid arguments: " + "; ".join(problems)


def answer_argument_errors_as_tool_errors(server: MCPServer) -> None:
    """Type errors the SDK finds read like the tools' own argument errors."""
    call_tool = server.call_tool

    async def checked_call_tool(name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        try:
            return await call_tool(name, arguments, context)
        except ToolError as exc:
            if isinstance(exc.__cause__, ValidationError):
                raise ToolError(f"Error executing tool {name}: {validation_text(exc.__cause__)}") from exc.__cause__
            raise

    server.call_tool = checked_call_tool  # type: ignore[method-assign]


def answer_unknown_prompts_with_invalid_params(server: MCPServer) -> None:
    """`prompts/get` of a prompt this server does not have is the client's mistake
    (-32602), not an error without a code (the SDK's ValueError becomes code 0)."""
    get_prompt = server.get_prompt

    async def checked_get_prompt(name: str, arguments: dict[str, Any] | None = None, context: Any = None) -> Any:
        if name not in {prompt.name for prompt in await server.list_prompts()}:
            raise MCPError(code=INVALID_PARAMS, message=f"unknown prompt: {name}")
        return await get_prompt(name, arguments, context)

    server.get_prompt = checked_get_prompt  # type: ignore[method-assign]
