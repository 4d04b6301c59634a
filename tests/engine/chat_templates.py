"""Chat templates written for the tests, each using the jinja of one family's template.

They are not the models' templates (those ship with the weights); they use what
those templates use, so the renderer is tested on it:

- TURNS_TEMPLATE (as Gemma's): the system message folded into the first user turn,
  ``messages[1:]`` slicing, roles renamed, alternation checked with
  ``loop.index0`` and ``raise_exception``, content as a string or a list of parts
  (``is string`` / ``is iterable``), ``trim``.
- TOOLS_TEMPLATE (as Qwen2.5's and Qwen3's): tools rendered with ``tojson``, tool
  calls whose arguments are a string or a mapping, tool results grouped into one
  turn (``loop.previtem`` / ``loop.nextitem``), a ``namespace`` scanned over
  ``messages[::-1]``, reasoning cut out with ``split``, ``startswith``/``endswith``.
"""

from __future__ import annotations

TURNS_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0].role == 'system' -%}
  {%- set preamble = messages[0].content ~ '\\n\\n' -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set preamble = '' -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
  {%- if (m.role == 'user') != (loop.index0 is even) -%}
    {{ raise_exception('turns must alternate user, assistant, user, ...') }}
  {%- endif -%}
  {{ '<start_of_turn>' ~ ('model' if m.role == 'assistant' else m.role) ~ '\\n' }}
  {%- if loop.first %}{{ preamble }}{% endif -%}
  {%- if m.content is string -%}
    {{ m.content | trim }}
  {%- elif m.content is iterable -%}
    {%- for part in m.content -%}
      {%- if part.type == 'text' %}{{ part.text | trim }}{% elif part.type == 'image' %}<image>{% endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif -%}"""

TOOLS_TEMPLATE = """{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- set ns = namespace(last_query=messages | length - 1, seen=false) -%}
{%- for m in messages[::-1] -%}
  {%- set i = messages | length - 1 - loop.index0 -%}
  {%- if not ns.seen and m.role == 'user' and m.content is string
        and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) -%}
    {%- set ns.seen = true -%}
    {%- set ns.last_query = i -%}
  {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'system' and loop.first -%}
  {%- elif m.role == 'user' or m.role == 'system' -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
    {%- set text = m.content if m.content is string else '' -%}
    {%- set thought = '' -%}
    {%- if '</think>' in text -%}
      {%- set thought = text.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
      {%- set text = text.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
<|im_start|>assistant
{% if thought and loop.index0 > ns.last_query %}<think>
{{ thought }}
</think>

{% endif %}{{ text }}
    {%- for call in m.tool_calls or [] -%}
      {%- set f = call.function if call.function is defined else call -%}
      {{ '\\n' if text or not loop.first else '' }}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>
    {%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ m.content }}
</tool_response>
    {%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>
{% endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Find a city's population, in <b>thousands</b> & 'rounded'.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

TURNS_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "  2+2?  "}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": [{"type": "text", "text": "Another, in 日本語 "},
                                  {"type": "image"}, {"type": "text", "text": "please 🙂"}]}],
]

TOOLS_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Reply in JSON."}, {"role": "user", "content": "Population of Oslo?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Oslo"}}},
         {"type": "function", "function": {"name": "lookup", "arguments": '{"city": "Bergen"}'}}]},
     {"role": "tool", "content": "709"}, {"role": "tool", "content": "291"},
     {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "a"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb"},
     {"role": "user", "content": "<tool_response>x</tool_response>"},
     {"role": "assistant", "content": "<think>ok</think>c"}],
]
