"""An outside agent trained by treadle through its OpenAI-compatible endpoint.

The agent is plain OpenAI-client code with a tool loop of its own: it calls the model, runs the
calculator for each tool call the model makes, sends the result back, and stops at a reply
without calls. treadle runs it once per episode with ``base_url`` pointed at its endpoint and
records every call's exact tokens; nothing here knows about treadle::

    treadle train recipes/calculator.yaml environment.name= \\
        environment.agent=examples.openai_agent:solve
"""

from __future__ import annotations

import json

from openai import OpenAI

from treadle.rollout.environments.calculator import calculate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate integer arithmetic exactly.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "e.g. (12 + 7) * 31"}
                },
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = (
    "You can call the calculate tool for arithmetic. Call it, read its result, then give the "
    "final answer without a call."
)


def solve(base_url: str, messages: list[dict], max_turns: int = 3) -> str:
    """One episode: the task's ``messages``, then model calls and tool results until the model
    answers without a call (or ``max_turns`` calls); returns the last reply's text."""
    client = OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "system", "content": SYSTEM}, *messages]
    content = ""
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        content = message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as e:
                result = f"Error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return content
