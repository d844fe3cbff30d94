"""Test doubles for the services luftpause sits between: a fake LLM engine and a fake MCP tool server."""
