"""An assistant turn's text -> its reasoning, its reply and its tool calls.

The format is Hermes's, which Qwen2.5 and Qwen3 are trained on and their chat templates render:
each call is one JSON object in its own block, ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``; several blocks in one turn are parallel calls. Reasoning comes first in a
``<think>...</think>`` block at the turn's start (Qwen3), or ends with a bare ``</think>`` when
the prompt opened it (the R1 distills' templates: ``thinking_opened=True``).

What a policy writes is not trusted: :func:`parse_assistant_turn` never raises. A block that is
not a valid call becomes a :class:`ParseError` beside the valid calls, for the environment to
send back to the model (:func:`error_message`) or to end the episode with, and to count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_ERROR_TEXT = 200
"""Characters of a malformed block kept in its :class:`ParseError` (a runaway block of
thousands of characters must not flood logs or the next prompt)."""


@dataclass(frozen=True)
class ToolCall:
    """One valid call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: Mapping[str, Any]
    id: str
    """``call_<k>``, k counting the turn's valid calls from 0 (OpenAI's ``tool_call_id``)."""


@dataclass(frozen=True)
class ParseError:
    """A ``<tool_call>`` block that is not a valid call."""

    reason: str
    """What is wrong, in words the model can act on (e.g. ``invalid JSON: Expecting ','
    delimiter at character 31``)."""
    text: str
    """The block's text, cut to :data:`MAX_ERROR_TEXT` characters."""


@dataclass(frozen=True)
class AssistantTurn:
    """The parts of one assistant turn's text."""

    content: str
    """The reply: the text outside the reasoning and the call blocks, stripped."""
    reasoning: str | None = None
    """The text of the ``<think>`` block, stripped; None when the turn has none."""
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[ParseError, ...] = field(default=())


def parse_assistant_turn(text: str, thinking_opened: bool = False) -> AssistantTurn:
    """Split ``text`` (one assistant turn as sampled, without the end-of-turn token) into
    reasoning, reply, valid tool calls and parse errors. Never raises for any string, and takes
    time linear in its length.

    - Reasoning: a ``<think>...</think>`` block at the start of the turn (after whitespace), or,
      with ``thinking_opened`` (the prompt ended in ``<think>``), the text up to the first
      ``</think>``. A turn cut while thinking (no ``</think>``) is all reasoning, with no calls.
      Think tags anywhere else are text of the reply or of a call's JSON.
    - Calls: each ``<tool_call>...</tool_call>`` after the reasoning holds one JSON object with a
      non-empty string ``"name"`` and ``"arguments"`` as an object, or as a string holding a JSON
      object (some models write it so), or absent (``{}``); ``"parameters"`` is read as an alias.
      ``NaN``, ``Infinity`` and unpaired surrogates are not JSON here.
    - A ``<tool_call>`` never closed (the turn ran out of tokens inside it) is an error, and the
      text from it on is not part of the reply.
    """
    reasoning, rest = _split_reasoning(text, thinking_opened)
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    reply: list[str] = []
    at = 0
    while (start := rest.find(CALL_OPEN, at)) >= 0:
        reply.append(rest[at:start])
        body_at = start + len(CALL_OPEN)
        end = rest.find(CALL_CLOSE, body_at)
        if end < 0:
            unclosed = rest[body_at:]
            errors.append(
                ParseError(f"{CALL_OPEN} is never closed by {CALL_CLOSE}", _cut(unclosed))
            )
            at = len(rest)
            break
        parsed = _parse_call(rest[body_at:end].strip(), len(calls))
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(parsed)
        at = end + len(CALL_CLOSE)
    reply.append(rest[at:])
    return AssistantTurn("".join(reply).strip(), reasoning, tuple(calls), tuple(errors))


def error_message(error: ParseError) -> str:
    """What to tell the model about a malformed call (the text of a ``tool`` message)."""
    return (
        f"Error: the tool call could not be parsed ({error.reason}). Write each call as "
        f'{CALL_OPEN}{{"name": "<tool name>", "arguments": {{...}}}}{CALL_CLOSE}.'
    )


def _split_reasoning(text: str, thinking_opened: bool) -> tuple[str | None, str]:
    if not thinking_opened:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        text = stripped[len(THINK_OPEN) :]
    thought, closed, rest = text.partition(THINK_CLOSE)
    if not closed:  # cut while thinking
        return thought.strip(), ""
    return thought.strip(), rest


def _parse_call(body: str, index: int) -> ToolCall | ParseError:
    try:
        call = _strict_json(body)
    except json.JSONDecodeError as e:
        return ParseError(f"invalid JSON: {e.msg} at character {e.pos}", _cut(body))
    except (ValueError, RecursionError):  # e.g. nesting too deep for the decoder
        return ParseError("invalid JSON", _cut(body))
    if not isinstance(call, dict):
        return ParseError('a call is a JSON object with "name" and "arguments"', _cut(body))
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return ParseError('"name" is missing or not a non-empty string', _cut(body))
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _strict_json(arguments)
        except (ValueError, RecursionError):
            return ParseError('"arguments" is a string that is not JSON', _cut(body))
    if not isinstance(arguments, dict):
        return ParseError('"arguments" must be a JSON object', _cut(body))
    try:  # an escaped lone surrogate decodes, and fails later in any tokenizer or log
        json.dumps([name, arguments], ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError, RecursionError):
        return ParseError("the call holds characters that are not valid Unicode", _cut(body))
    return ToolCall(name.strip(), arguments, f"call_{index}")


def _strict_json(text: str) -> Any:
    """``json.loads`` without the ``NaN``/``Infinity`` extension, nor numbers that overflow to
    infinity (``1e999``) (raises ``ValueError``)."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of a float's range")
    return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_TEXT else text[:MAX_ERROR_TEXT] + "..."
