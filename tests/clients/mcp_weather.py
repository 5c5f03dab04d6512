"""A one-tool MCP server over stdio (the `mcp` package), for a coding agent's config: the
tool `get_weather(city)`. `python tests/clients/mcp_weather.py` serves it."""

from __future__ import annotations

try:  # mcp 2.x
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer

server = MCPServer("weather")


@server.tool()
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


if __name__ == "__main__":
    server.run()
