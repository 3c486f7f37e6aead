"""Structured-output cases on the default model: JSON schemas of growing
difficulty, a regex, a choice list and an EBNF grammar, each with ten chat
prompts. Shared by tests/test_structured_output.py and
benchmarks/bench_structured.py, so the benchmark measures what the tests check.
"""

from __future__ import annotations

from typing import Any

# A flat object, every property required.
FLAT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
}
# Nested: an array of objects, enums, bounded arrays.
NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "genre": {"type": "string", "enum": ["fiction", "science", "history", "poetry"]},
        "authors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "role": {"enum": ["author", "editor"]},
                },
                "required": ["name", "role"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 4},
    },
    "required": ["title", "genre", "authors", "tags"],
}
# Required and optional properties, nothing else allowed.
OPTIONAL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "email": {"type": "string", "maxLength": 40},
        "nickname": {"type": "string", "maxLength": 20},
        "verified": {"type": "boolean"},
    },
    "required": ["id", "verified"],
    "additionalProperties": False,
}
# Numbers with bounds.
BOUNDS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
    },
    "required": ["temperature", "humidity", "wind_kmh"],
}

SUBJECTS = [
    "Paris",
    "a cat",
    "the moon",
    "a bakery",
    "Ada Lovelace",
    "a volcano",
    "jazz",
    "a bicycle",
    "Tokyo",
    "a lighthouse",
]

# name -> (schema, prompt template, disable_any_whitespace)
SCHEMAS: dict[str, tuple[dict[str, Any], str, bool]] = {
    "flat": (FLAT, "Describe a person who lives in {} as JSON.", False),
    "nested": (NESTED, "Describe a book about {} as JSON.", True),
    "optional": (OPTIONAL, "Make a JSON user profile for a fan of {}.", True),
    "bounds": (BOUNDS, "Give today's weather near {} as JSON.", False),
}

DATE_REGEX = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
DATE_PROMPT = "On what date did you last think about {}? Answer with a date."
SENTIMENTS = ["positive", "negative", "neutral"]
SENTIMENT_PROMPT = "What is the sentiment of: 'I think {} is wonderful'?"
# Arithmetic, bounded so that a model cannot run on forever: at most three
# terms, each a number or one parenthesized operation.
ARITHMETIC = r"""
root ::= expr
expr ::= term (" " op " " term)? (" " op " " term)?
term ::= number | "(" number " " op " " number ")"
op ::= "+" | "-" | "*" | "/"
number ::= [1-9] [0-9]? [0-9]?
"""
ARITHMETIC_PROMPT = "Write an arithmetic expression whose result is the number of letters in '{}'."


def chat(template: str) -> list[list[dict[str, str]]]:
    """The template's ten chat prompts."""
    return [[{"role": "user", "content": template.format(s)}] for s in SUBJECTS]


# Hostile schemas (tests/test_structured_output_limits.py): each makes
# xgrammar recurse once per link or level, or take time super-linear in it.
def flat_ref_chain(n: int) -> dict[str, Any]:
    """``$ref`` to ``$ref`` ... n links, then an integer."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def object_ref_chain(n: int) -> dict[str, Any]:
    """n objects, each holding the next by ``$ref``."""
    defs: dict[str, Any] = {
        f"d{i}": {
            "type": "object",
            "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["n"],
        }
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_objects(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"n": schema}, "required": ["n"]}
    return schema


def nested_arrays(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema
