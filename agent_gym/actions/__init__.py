"""How a reply calls a tool: ``tools`` is the one strict tool-call parser, ``protocols`` the
action protocols an env composes (tool calls, tags, fenced code)."""
