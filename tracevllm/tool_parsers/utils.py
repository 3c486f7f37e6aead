"""The JSON schema a forced tool call is generated under.

Mirrors vllm/tool_parsers/utils.py (``get_json_schema_from_tools``,
``_get_json_schema_from_tools``, ``_get_tool_schema_from_tool``,
``_get_tool_schema_defs``): what vLLM's base ``ToolParser.adjust_request``
puts into ``structured_outputs`` for ``tool_choice`` = a named function (its
parameters' schema) or ``"required"`` (an array of one or more
``{"name": ..., "parameters": ...}`` calls, one ``anyOf`` branch per tool).
Departures: a named function without ``parameters`` is held to an object
(vLLM leaves its arguments unconstrained text); the tools' ``$defs`` are
shared, not popped out of the request's tools; and the ``"required"``
schema, which holds each tool's parameters five levels deeper than they
are, is checked against structured outputs' limits naming ``tools`` (each
tool's own parameters were checked when the request was parsed). Nothing
is copied (vLLM's way): a copy of a schema recurses once per level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracevllm.structured_output.limits import check_json_schema

if TYPE_CHECKING:
    from tracevllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionToolsParam,
        ToolChoice,
    )

# What a function without ``parameters`` takes (vLLM's default for "required").
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _get_tool_schema_defs(tools: list[ChatCompletionToolsParam]) -> dict[str, Any]:
    """Every tool's ``$defs`` in one place (a ``$ref`` resolves from the root)."""
    all_defs: dict[str, Any] = {}
    for tool in tools:
        for name, schema in (tool.function.parameters or {}).get("$defs", {}).items():
            if name in all_defs and all_defs[name] != schema:
                raise ValueError(
                    f"Tool definition '{name}' has multiple schemas, which is not supported."
                )
            all_defs[name] = schema
    return all_defs


# --8<-- [start:tool_schema]
def _get_tool_schema_from_tool(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    """One branch of the "required" array's items: this tool's name and parameters."""
    params = {k: v for k, v in (tool.function.parameters or _NO_PARAMETERS).items() if k != "$defs"}
    return {
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": params,
        },
        "required": ["name", "parameters"],
    }


def _get_json_schema_from_tools(tools: list[ChatCompletionToolsParam]) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [_get_tool_schema_from_tool(t) for t in tools]},
    }
    if defs := _get_tool_schema_defs(tools):
        schema["$defs"] = defs
    return schema


# --8<-- [end:tool_schema]


def get_json_schema_from_tools(
    tool_choice: ToolChoice, tools: list[ChatCompletionToolsParam] | None
) -> dict[str, Any] | None:
    """The schema the reply must follow, or None ("none", "auto": no constraint)."""
    if tool_choice in ("none", None) or tools is None:
        return None
    if isinstance(tool_choice, str):
        if tool_choice != "required":
            return None
        schema = _get_json_schema_from_tools(tools)
        # tracevllm: the array of calls around the tools adds 5 levels, and
        # its $refs, patterns and text are all the tools' together.
        check_json_schema(schema, 'tools, as tool_choice "required" nests them in its array')
        return schema
    name = tool_choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise ValueError(f"Tool '{name}' has not been passed in `tools`.")
    return tool.function.parameters or _NO_PARAMETERS
