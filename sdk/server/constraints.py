"""From an OpenAI request's constraint fields to a formcast :class:`OutputSpec`.

One request names at most one constraint, through any of: ``response_format``
(``json_schema`` / ``json_object``; ``text`` is none), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``) or its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, or
``tools`` with ``tool_choice`` "required" or a named function (the arguments are
generated under the function's parameter schema), or "auto" (also the default when
tools are given and nothing else constrains the answer): the model writes either
``{"content": its answer in words}`` or a call, ``{"name": ..., "arguments": ...}``,
and the server hands back the text or the ``tool_calls``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from formcast.errors import ConstraintError
from formcast.server.protocol import ChatCompletionRequest, CompletionRequest, Tool
from formcast.spec import OutputSpec, output_spec, parse_json

# the JSON a choice among several tools writes: which one, with what; or ("auto") words
_TOOL_NAME, _TOOL_ARGS, _TOOL_TEXT = "name", "arguments", "content"


@dataclass(frozen=True, kw_only=True)
class ToolPlan:
    """How a forced tool call is generated and read back.

    Attributes
    ----------
    tools : list[Tool]
        The functions the call may name (one for a named ``tool_choice``).
    wrapped : bool
        The output is ``{"name": ..., "arguments": {...}}`` (a choice among
        several tools); otherwise it is the one function's arguments.
    optional : bool
        ``tool_choice`` "auto": the output may instead be ``{"content": text}``.
    """

    tools: list[Tool]
    wrapped: bool
    optional: bool = False

    def read(self, text: str) -> tuple[str | None, str]:
        """(function name, arguments as JSON text) of a finished output; (None, the
        answer's text) when the model answered in words."""
        if not self.wrapped:
            return self.tools[0].function.name, text
        value = json.loads(text)
        if _TOOL_NAME not in value:
            return None, value[_TOOL_TEXT]
        return value[_TOOL_NAME], json.dumps(value[_TOOL_ARGS], ensure_ascii=False)

    def instructions(self) -> str:
        """A system message that tells the model which function to call."""
        lines = ["You call a function. Answer with its arguments as a JSON object."
                 if not self.wrapped else
                 'You may call one of these functions. To call one, answer with JSON: '
                 '{"name": the function, "arguments": its arguments}. To answer in words '
                 'instead, answer with JSON: {"content": your answer}.' if self.optional else
                 'You call one of these functions. Answer with JSON: {"name": the '
                 'function, "arguments": its arguments}.']
        for tool in self.tools:
            fn = tool.function
            lines.append(f"- {fn.name}: {fn.description or ''} parameters: "
                         f"{json.dumps(_parameters(tool))}")
        return "\n".join(lines)


def json_spec(schema: Any, *, strict: bool = True) -> OutputSpec:
    """JSON under ``schema`` (a dict, bool or JSON text), validated with jsonschema.

    ``strict=False`` leaves objects open to properties the schema does not name
    (``json_object`` needs it; formcast closes objects by default).
    """
    if strict:
        return output_spec(json_schema=schema)
    from formcast import grammars

    if isinstance(schema, str):
        schema = output_spec(json_schema=schema).json_schema
    return OutputSpec(kind="json", constraint=grammars.JsonSchema(schema, strict=False),
                      parser=lambda text: parse_json(text, schema), json_schema=schema)


def request_spec(req: ChatCompletionRequest | CompletionRequest
                 ) -> tuple[OutputSpec, ToolPlan | None]:
    """The output spec of a request, and its forced tool call if any.

    Raises
    ------
    ConstraintError
        More than one constraint, a malformed one, or a tool choice naming no
        given tool.
    """
    given: dict[str, OutputSpec] = {}
    plan = _tool_plan(req) if isinstance(req, ChatCompletionRequest) else None
    if plan is not None and plan.optional and isinstance(req, ChatCompletionRequest) \
            and req.tool_choice is None and _other_constraint(req):
        plan = None  # (tools without a tool_choice beside a constraint: the constraint rules)
    if plan is not None:
        given["tools"] = _tool_spec(plan)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given["response_format"] = json_spec({"type": "object"}, strict=False)
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ConstraintError("response_format json_schema needs json_schema.schema")
        given["response_format"] = json_spec(rf.json_schema.schema_,
                                             strict=rf.json_schema.strict is not False)
    so = req.structured_outputs
    fields = {"structured_outputs.json": None if so is None else so.json_,
              "structured_outputs.regex": None if so is None else so.regex,
              "structured_outputs.choice": None if so is None else so.choice,
              "structured_outputs.grammar": None if so is None else so.grammar,
              "guided_json": req.guided_json, "guided_regex": req.guided_regex,
              "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar}
    for name, value in fields.items():
        if value is not None:
            given[name] = _field_spec(name.rsplit(".", 1)[-1].removeprefix("guided_"), value)
    if len(given) > 1:
        raise ConstraintError(f"give at most one constraint, got {', '.join(sorted(given))}")
    if not given:
        return OutputSpec(kind="text"), None
    return next(iter(given.values())), plan


def _field_spec(kind: str, value: Any) -> OutputSpec:
    if kind == "json":
        return json_spec(value)
    if kind == "regex":
        return output_spec(regex=value)
    if kind == "choice":
        return output_spec(choices=value)
    # vLLM takes EBNF (GBNF, with ::=) or Lark grammars in the same field
    return output_spec(grammar=value) if "::=" in value else output_spec(lark=value)


def _other_constraint(req: ChatCompletionRequest) -> bool:
    so = req.structured_outputs
    return (req.response_format is not None and req.response_format.type != "text") or any(
        v is not None for v in (so, req.guided_json, req.guided_regex, req.guided_choice,
                                req.guided_grammar))


def _tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    choice, tools = req.tool_choice, req.tools or []
    if choice == "none" or (choice in (None, "auto") and not tools):
        return None  # (free text)
    if choice in (None, "auto"):  # (OpenAI's default when tools are given)
        return ToolPlan(tools=tools, wrapped=True, optional=True)
    if not tools:
        raise ConstraintError("tool_choice needs tools")
    if choice == "required":
        return ToolPlan(tools=tools, wrapped=len(tools) > 1)
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise ConstraintError(f"tool_choice names {choice.function.name!r}, which is not "
                              f"among the tools ({', '.join(t.function.name for t in tools)})")
    return ToolPlan(tools=named[:1], wrapped=False)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _tool_spec(plan: ToolPlan) -> OutputSpec:
    if not plan.wrapped:
        tool = plan.tools[0]
        return json_spec(_parameters(tool), strict=tool.function.strict is not False)
    calls = [{"type": "object", "properties": {_TOOL_NAME: {"const": t.function.name},
                                               _TOOL_ARGS: _parameters(t)},
              "required": [_TOOL_NAME, _TOOL_ARGS]} for t in plan.tools]
    words = [{"type": "object", "properties": {_TOOL_TEXT: {"type": "string"}},
              "required": [_TOOL_TEXT]}] if plan.optional else []
    return json_spec({"anyOf": words + calls})
