"""Serving an env over HTTP, WebSocket and MCP (``app``), its Gymnasium client (``remote``)
and Ray actors that host envs elsewhere (``distributed``)."""
