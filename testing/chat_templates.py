"""Chat templates for checkpoints tests build: ChatML, and ChatML that shows tools the way
Qwen 2.5 / Hermes models are taught (the tools as JSON in the system turn, calls as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a tool's answer in a ``tool``
turn). Without tools the second renders exactly what the first does."""

from __future__ import annotations

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CHATML_WITH_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ 'You may call these functions:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ (tool | tojson) + '\\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message.tool_calls %}{{ '<|im_start|>assistant\\n' + message['content'] }}"
    "{% for call in message.tool_calls %}{{ '<tool_call>' + ({'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
