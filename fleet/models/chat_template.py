"""The ChatML chat template of the models fleet makes itself.

It renders tools into the system turn and an assistant's tool calls as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`; mlx-lm recognises that shape (the
`<tool_call>` tag next to `tool_call.name`) and picks its JSON tool parser. Content may be a
string or a list of OpenAI-style parts, of which the text parts are kept.
"""

from __future__ import annotations

# No whitespace control in the tags: the text is exact. Transformers renders with trim_blocks,
# which eats a newline right after a block tag, so such newlines are written as expressions.
_NL = "{{ '\\n' }}"

CHATML_WITH_TOOLS = (
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content is iterable %}"
    "{% for part in content if part.type == 'text' %}{{ part.text }}{% endfor %}"
    "{% endif %}"
    "{% endmacro %}"
    "{% set first_is_system = messages and messages[0].role == 'system' %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if first_is_system %}{{ text(messages[0].content) }}\n\n{% endif %}"
    "You can call functions. Each function is one JSON object inside <tools></tools>:\n"
    "<tools>"
    "{% for tool in tools %}" + _NL + "{{ tool | tojson }}{% endfor %}" + _NL + "</tools>\n"
    'To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "<|im_end|>\n"
    "{% elif first_is_system %}"
    "<|im_start|>system\n{{ text(messages[0].content) }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (loop.first and first_is_system) %}"
    "<|im_start|>{{ message.role }}\n{{ text(message.content) }}"
    "{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    + _NL
    + '<tool_call>{"name": "{{ tool_call.name }}", "arguments": '
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
