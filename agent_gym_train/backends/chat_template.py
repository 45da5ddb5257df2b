"""SmolLM2's chat template, taught to show tools and render tool calls.

SmolLM2-135M-Instruct ships a plain ChatML template: it drops the ``tools`` it is given and
the ``tool_calls`` of an assistant message. So the embedded model was told to "call the
`search` tool" without ever seeing the tool or the form of a call, and TRL, which checks that
a template renders a whole tool exchange before it trains with tools, refused to start with
it at all. ``TOOL_CHAT_TEMPLATE`` is that template with three additions, and renders
everything else exactly as the original does:

* with ``tools``, the system turn (SmolLM2's default one when the chat has none) lists them
  in a ``<tools>`` block and says how to call one;
* an assistant message's ``tool_calls`` follow its content in the Hermes form that
  ``agent_gym.actions.tools`` parses and ``format_tool_call`` writes, laid out byte for byte
  as it writes them (``tojson`` here is ``json.dumps(ensure_ascii=False)``, as there), so a
  call rendered from structured ``tool_calls`` is the very text a model would have sampled;
* a ``tool`` message is a ChatML turn of its own, as before.

Every message renders from itself alone, so adding messages never changes how earlier ones
render: prompts grow by extension (``agent_gym.render``), as token-continuous training needs.

``TOOL_RESPONSE_TEMPLATE`` is the matching ``response_template`` (transformers' declarative
reply parser, which TRL uses to find the calls in a sampled reply).
"""

from __future__ import annotations

from typing import Any

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOOL_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set chat = messages[1:] %}"
    "{%- else %}"
    "{%- set system = '" + SMOLLM2_SYSTEM + "' %}{%- set chat = messages %}"
    "{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou can call these functions, described in "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, end your reply with exactly one call, written as:\\n"
    "<tool_call>\\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\\n"
    "</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in chat %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{%- set function = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (function.name | tojson) + ', \"arguments\": ' }}"
    "{%- if function.arguments is string %}{{- function.arguments }}"
    "{%- else %}{{- function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOL_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
