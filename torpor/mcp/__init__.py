"""MCP servers as tool sources: ``AgentConfig(mcp_servers=[MCPServerStdio(...), ...])``.

A server's tools join the agent's own (see :mod:`torpor.mcp.view` for names); a runtime
holds one session per server, shared by every agent that names it
(:mod:`torpor.mcp.link`). Needs the ``mcp`` package (``pip install 'torpor[mcp]'``)
once an agent uses a server; configuring one does not.

A tool annotated ``destructiveHint: true``, or named by ``require_approval``, suspends
the turn like an :class:`~torpor.ExternalTool`: ``resolve(conversation_id, call_id,
APPROVED)`` runs it (the result the model reads is the tool's), any other answer is
what the model reads instead (pass ``is_error=True`` for a refusal).
"""

from torpor.actors.resolution import APPROVED
from torpor.mcp.servers import MCPServer, MCPServerHTTP, MCPServerStdio

__all__ = ["APPROVED", "MCPServer", "MCPServerHTTP", "MCPServerStdio"]
