"""The assistant-turn parser: reasoning, reply and Hermes/Qwen tool calls, and no exception for
anything a policy can write."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from treadle.rollout.environments.tool_calls import (
    MAX_ERROR_TEXT,
    AssistantTurn,
    ParseError,
    ToolCall,
    error_message,
    parse_assistant_turn,
)

QWEN3 = Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers" / "qwen3"


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_turn_without_calls_is_its_reply():
    assert parse_assistant_turn("  The answer is 42.\n") == AssistantTurn("The answer is 42.")


def test_one_call_after_a_sentence():
    turn = parse_assistant_turn("Let me multiply.\n" + call("multiply", {"a": 123, "b": 456}))
    assert turn == AssistantTurn(
        "Let me multiply.", None, (ToolCall("multiply", {"a": 123, "b": 456}, "call_0"),)
    )


def test_parallel_calls_keep_their_order_and_ids():
    text = call("add", {"a": 1, "b": 2}) + "\n" + call("add", {"a": 3, "b": 4})
    turn = parse_assistant_turn(text)
    assert [(c.name, dict(c.arguments), c.id) for c in turn.tool_calls] == [
        ("add", {"a": 1, "b": 2}, "call_0"),
        ("add", {"a": 3, "b": 4}, "call_1"),
    ]
    assert turn.content == "" and turn.errors == ()


def test_arguments_as_a_json_string_or_absent_or_named_parameters():
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>'
    assert parse_assistant_turn(as_string).tool_calls[0].arguments == {"x": [1, 2]}
    absent = '<tool_call>{"name": "now"}</tool_call>'
    assert parse_assistant_turn(absent).tool_calls == (ToolCall("now", {}, "call_0"),)
    alias = '<tool_call>{"name": "f", "parameters": {"y": 1}}</tool_call>'
    assert parse_assistant_turn(alias).tool_calls[0].arguments == {"y": 1}


def test_braces_and_tags_inside_json_strings_do_not_end_the_call():
    text = call("echo", {"s": "}{ not the end"})
    assert parse_assistant_turn(text).tool_calls[0].arguments == {"s": "}{ not the end"}


def test_reasoning_is_separated_with_or_without_the_opening_tag():
    qwen3 = "<think>\n12 x 13 is hard.\n</think>\n\n" + call("multiply", {"a": 12, "b": 13})
    turn = parse_assistant_turn(qwen3)
    assert turn.reasoning == "12 x 13 is hard." and turn.content == ""
    assert turn.tool_calls[0].name == "multiply"
    # the R1 distills' prompt opens <think>: the turn starts inside it
    distill = "so 156.\n</think>\n\nThe product is 156."
    assert parse_assistant_turn(distill, thinking_opened=True) == AssistantTurn(
        "The product is 156.", "so 156."
    )
    # without that, a bare </think> is text of the reply
    assert parse_assistant_turn(distill) == AssistantTurn(distill.strip())


def test_think_tags_elsewhere_are_text_not_reasoning():
    in_json = call("f", {"s": "</think>"})
    assert parse_assistant_turn(in_json).tool_calls == (ToolCall("f", {"s": "</think>"}, "call_0"),)
    mid = parse_assistant_turn("Use the <think> tag. " + call("f", {}))
    assert mid.reasoning is None and mid.content == "Use the <think> tag."
    assert mid.tool_calls == (ToolCall("f", {}, "call_0"),)


def test_a_call_written_while_thinking_is_not_a_call():
    turn = parse_assistant_turn("<think>maybe " + call("f", {}) + "</think>No call.")
    assert turn.tool_calls == () and turn.errors == () and turn.content == "No call."


def test_a_turn_cut_while_thinking_is_all_reasoning():
    turn = parse_assistant_turn("\n<think>first I " + call("f", {}))
    assert turn.reasoning.startswith("first I <tool_call>") and turn.tool_calls == ()
    assert turn.content == "" and turn.errors == ()


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        ('{"name": "f", "arguments": {"a": 1,}}', "invalid JSON: Expecting property name"),
        ('["f", {"a": 1}]', 'a call is a JSON object with "name" and "arguments"'),
        ('{"arguments": {"a": 1}}', '"name" is missing'),
        ('{"name": "", "arguments": {}}', '"name" is missing'),
        ('{"name": "f", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
        ('{"name": "f", "arguments": "a=1"}', '"arguments" is a string that is not JSON'),
        ("[" * 100_000, "invalid JSON"),  # deeper than the decoder's recursion limit
        ('{"name": "f", "arguments": {"x": NaN}}', "invalid JSON"),  # Python's extension
        ('{"name": "f", "arguments": "{\\"x\\": Infinity}"}', '"arguments" is a string'),
        ('{"name": "f", "arguments": {"s": "\\ud800"}}', "the call holds characters"),
    ],
)
def test_a_malformed_call_is_an_error_beside_the_valid_ones(block, reason):
    text = f"Trying.\n<tool_call>{block}</tool_call>\n" + call("ok", {"a": 1})
    turn = parse_assistant_turn(text)
    assert turn.content == "Trying."
    assert turn.tool_calls == (ToolCall("ok", {"a": 1}, "call_0"),)  # ids count valid calls
    (error,) = turn.errors
    assert error.reason.startswith(reason)
    assert len(error.text) <= MAX_ERROR_TEXT + 3  # cut to 200 characters, then "..."


def test_an_unclosed_call_is_an_error_and_not_part_of_the_reply():
    turn = parse_assistant_turn('I will call.\n<tool_call>\n{"name": "f", "argum')
    assert turn.content == "I will call." and turn.tool_calls == ()
    assert turn.errors == (
        ParseError("<tool_call> is never closed by </tool_call>", '\n{"name": "f", "argum'),
    )


def test_many_unclosed_calls_take_one_pass():
    # A collapsed policy repeating the tag: with a lazy regex each opening tag rescanned the
    # rest (20,000 tags: minutes); the scan stops at the first one that is never closed.
    turn = parse_assistant_turn("Go " + "<tool_call>" * 20_000)
    assert turn.content == "Go" and turn.tool_calls == () and len(turn.errors) == 1
    # the 19,999 tags after the first, cut to 200 characters: 18 x 11 = 198, then "<t" and "..."
    assert turn.errors[0].text == "<tool_call>" * 18 + "<t..."


def test_a_runaway_block_is_cut_in_the_error():
    turn = parse_assistant_turn("<tool_call>" + "x" * 10_000 + "</tool_call>")
    assert turn.errors[0].text == "x" * MAX_ERROR_TEXT + "..."


def test_the_error_message_names_the_reason_and_the_format():
    msg = error_message(ParseError("invalid JSON: Expecting value at character 0", "oops"))
    assert msg == (
        "Error: the tool call could not be parsed (invalid JSON: Expecting value at character 0). "
        'Write each call as <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>.'
    )


def test_random_text_never_raises():
    # 2,000 strings of tag fragments, JSON punctuation and words, seeded: the parser returns for
    # each, and every valid call it reports has a name and object arguments.
    tags = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
    json_bits = ["{", "}", "[", "]", '"', ":", ",", '"name"', '"arguments"', '"f"', "1", "null"]
    pieces = [*tags, *json_bits, " ", "\n", "text", "\\"]
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        turn = parse_assistant_turn(text)
        assert all(c.name and isinstance(c.arguments, dict) for c in turn.tool_calls)


@pytest.mark.skipif(not QWEN3.is_dir(), reason=f"needs the Qwen3 tokenizer at {QWEN3}")
def test_calls_rendered_by_the_qwen3_template_parse_back():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QWEN3)
    calls = [("multiply", {"a": 123, "b": 456}), ("add", {"a": 1, "b": 2})]
    messages = [
        {"role": "user", "content": "What is 123 x 456, and 1 + 2?"},
        {
            "role": "assistant",
            "content": "I will use the tools.",
            "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
            ],
        },
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assistant = rendered.rsplit("<|im_start|>assistant\n", 1)[1].split("<|im_end|>")[0]
    assert "<tool_call>" in assistant  # the template's own rendering, not ours
    turn = parse_assistant_turn(assistant)
    assert turn.content == "I will use the tools." and turn.errors == ()
    assert [(c.name, dict(c.arguments)) for c in turn.tool_calls] == calls
