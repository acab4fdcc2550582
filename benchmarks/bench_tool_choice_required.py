"""``tool_choice: "required"`` (and named) on the bundled model: how many responses are valid
calls, per ``--tool-call-parser`` (docs/openai.md, Tool calls).

Per parser one server (``sgl_jax.testing.ServerProcess``, the bundled random-weight model,
whose chat template renders no tools, so no markup is more natural to it than another: every
parser is measured). Through the official ``openai`` client, ``--requests`` chat requests with
2 or 3 declared tools at temperature 1.0, each with its own seed; every 4th names a tool, the
others ask for ``"required"``. A response counts as a valid call when its finish reason is
``tool_calls``, it holds exactly one call, of a declared tool (the named one when named), and
its arguments are a JSON object that matches the tool's ``parameters`` (checked by
``valid`` below, a validator of the keywords used, independent of the grammar code). For
contrast, ``--auto`` requests per parser ask ``tool_choice: "auto"`` (no grammar).

    python benchmarks/bench_tool_choice_required.py --requests 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

sys.path.insert(0, os.path.dirname(__file__))

from bench_utils import machine_description, markdown_table  # noqa: E402

from sgl_jax.srt.entrypoints.openai.tool_parsers import TOOL_PARSERS  # noqa: E402
from sgl_jax.testing import ServerProcess, server_flags  # noqa: E402


def _tool(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} tool",
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          ["city", "days"]),
    _tool("search_docs", {"query": {"type": "string", "maxLength": 24},
                          "limit": {"type": "integer", "minimum": 1, "maximum": 10},
                          "exact": {"type": "boolean"}}, ["query"]),
    _tool("set-alarm", {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                        "volume": {"type": "number", "minimum": 0, "maximum": 1},
                        "days": {"type": "array", "maxItems": 3,
                                 "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}}},
          ["hour"]),
]
PROMPTS = ["What's the weather in Paris?", "Find the docs about tool calls.",
           "Wake me up at seven.", "Hello!"]


def valid(value: Any, schema: dict[str, Any]) -> bool:
    """``value`` matches ``schema`` (the keywords TOOLS use)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(valid(value[k], s) for k, s in props.items() if k in value))
    if kind == "string":
        return (isinstance(value, str)
                and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30))
    if kind in ("integer", "number"):
        ok = isinstance(value, int) if kind == "integer" else isinstance(value, int | float)
        return (ok and not isinstance(value, bool)
                and schema.get("minimum", float("-inf")) <= value
                <= schema.get("maximum", float("inf")))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30)
                and all(valid(v, schema.get("items", {})) for v in value))
    return kind is None


def request(i: int, choice: str) -> dict[str, Any]:
    tools = TOOLS[: 2 + i % 2] if i % 3 else TOOLS[1:]
    tool_choice: Any = choice
    if choice == "required" and i % 4 == 3:
        tool_choice = {"type": "function",
                       "function": {"name": tools[i % len(tools)]["function"]["name"]}}
    return {"model": "default", "messages": [{"role": "user", "content": PROMPTS[i % 4]}],
            "tools": tools, "tool_choice": tool_choice, "temperature": 1.0, "seed": i}


def check(body: dict[str, Any], response: Any) -> str | None:
    """None for a valid call, else what is wrong."""
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    if choice.finish_reason != "tool_calls" or len(calls) != 1:
        return f"finish {choice.finish_reason}, {len(calls)} calls: {choice.message.content!r}"
    call = calls[0].function
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
    named = body["tool_choice"]
    if call.name not in schemas or (isinstance(named, dict)
                                    and call.name != named["function"]["name"]):
        return f"wrong tool {call.name!r}"
    try:
        args = json.loads(call.arguments)
    except ValueError:
        return f"arguments not JSON: {call.arguments!r}"
    return None if valid(args, schemas[call.name]) else f"{call.name}: {call.arguments}"


def run(parser: str, n: int, n_auto: int, max_tokens: int) -> dict[str, Any]:
    server = ServerProcess(server_flags(tool_call_parser=parser,
                                        constrained_json_disable_any_whitespace=True),
                           env={"JAX_PLATFORMS": "cpu"})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        bodies = [request(i, "required") for i in range(n)]
        bodies += [request(i, "auto") for i in range(n_auto)]

        def send(body: dict[str, Any]) -> tuple[str | None, int]:
            out = client.chat.completions.create(**body, max_tokens=max_tokens)
            return check(body, out), out.usage.completion_tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(send, bodies))
        wall = time.perf_counter() - t0
    finally:
        server.stop()
    forced, auto = results[:n], results[n:]
    errors = [e for e, _ in forced if e is not None]
    for e in errors[:3]:
        print(f"  {parser}: invalid: {e}", file=sys.stderr)
    return {"parser": parser, "responses": n, "valid": n - len(errors),
            "named": sum(isinstance(b["tool_choice"], dict) for b in bodies[:n]),
            "tokens": sum(t for _, t in forced) / max(n, 1),
            "auto": sum(e is None for e, _ in auto), "wall": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--auto", type=int, default=16, help="tool_choice 'auto' requests")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--parsers", nargs="+", default=list(TOOL_PARSERS),
                   choices=list(TOOL_PARSERS))
    args = p.parse_args()
    rows = [run(parser, args.requests, args.auto, args.max_tokens) for parser in args.parsers]
    print(f"# {machine_description()}; bundled model, temperature 1.0, seeds 0..{args.requests - 1}"
          f", max_tokens {args.max_tokens}\n")
    print(markdown_table(
        ["parser", "responses (named)", "valid calls", "valid %", "completion tokens / call",
         f"'auto': valid calls of {args.auto}", "wall s"],
        [[r["parser"], f"{r['responses']} ({r['named']})", r["valid"],
          f"{100 * r['valid'] / max(r['responses'], 1):.1f}", f"{r['tokens']:.1f}",
          r["auto"], f"{r['wall']:.1f}"] for r in rows]))


if __name__ == "__main__":
    main()
