"""The reward service's HTTP interface as an OpenAPI 3.1 document, served by ``treadle
serve-reward`` at ``GET /openapi.json`` (``tests/rewards/test_service.py`` checks it against
the real handler's requests and replies, both ways).

``POST /score`` takes ``{"items": [{"id", "task", "response"}, ...]}`` and answers ``{"scores":
[{"id", "reward", "correct"}, ...], "failures", "timeouts", "deadline_misses"}``, one score per
item, in request order; a task is :class:`~treadle.core.types.Task` as JSON. Any language can
be a client, and any server that answers this schema can be ``reward.functions: [{name:
remote, params: {url: ...}}]``.
"""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/schemas/Error"}


def _object(properties: dict[str, Any], required: list[str], description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _text(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


SCHEMAS: dict[str, Any] = {
    "Message": _object(
        {"role": _text("system, user, assistant or tool"), "content": _text("the text")},
        ["role", "content"],
        "One chat message.",
    ),
    "Task": _object(
        {
            "task_id": _text("stable id of the prompt; rollouts of one task form a group"),
            "messages": {"type": "array", "items": {"$ref": "#/components/schemas/Message"}},
            "answer": _text("gold answer (the verifier's reference); empty when none"),
            "domain": _text("routes the task to the reward functions of this domain"),
            "payload": _text("opaque JSON string a domain's verifier may need"),
            "reasoning": _text("worked steps of a gold solution; empty when none"),
        },
        ["task_id", "messages"],
        "A prompt and what its verifier needs (treadle.core.types.Task); fields left out are "
        "empty strings.",
    ),
    "Item": _object(
        {
            "id": _text(
                "the caller's id, echoed in the reply (other JSON values are read as their string)"
            ),
            "task": {"$ref": "#/components/schemas/Task"},
            "response": _text("the completion text, without the prompt"),
        },
        ["id", "task", "response"],
        "One completion of one task to score.",
    ),
    "ScoreRequest": _object(
        {"items": {"type": "array", "items": {"$ref": "#/components/schemas/Item"}}},
        ["items"],
        "A batch, scored at once by every worker of the service's pool.",
    ),
    "Score": _object(
        {
            "id": _text("the item's id"),
            "reward": {"type": "number", "description": "weighted sum over the functions"},
            "correct": {"type": "boolean", "description": "the primary verifier's judgement"},
        },
        ["id", "reward", "correct"],
        "One item's score.",
    ),
    "ScoreResponse": _object(
        {
            "scores": {"type": "array", "items": {"$ref": "#/components/schemas/Score"}},
            "failures": {"type": "integer", "description": "calls that raised (fallback)"},
            "timeouts": {"type": "integer", "description": "calls past reward.timeout_s"},
            "deadline_misses": {
                "type": "integer",
                "description": "calls cut by reward.step_timeout_s",
            },
        },
        ["scores", "failures", "timeouts", "deadline_misses"],
        "One score per item, in request order, and what went wrong computing them.",
    ),
    "Health": _object({"ok": {"type": "boolean"}}, ["ok"], "The service is up."),
    "Error": _object({"error": _text("what was wrong")}, ["error"], "A refused request."),
}


def _reply(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "treadle reward service",
        "version": "1",
        "description": "A recipe's reward functions behind HTTP (treadle serve-reward RECIPE).",
    },
    "paths": {
        "/score": {
            "post": {
                "summary": "Score a batch of (task, response) items",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/ScoreRequest"}
                        }
                    },
                },
                "responses": {
                    "200": _reply("the scores", {"$ref": "#/components/schemas/ScoreResponse"}),
                    "400": _reply(
                        "malformed JSON, nested over 64 levels, or missing fields", _ERROR
                    ),
                    "413": _reply("body over 16 MiB", _ERROR),
                    "422": _reply(
                        "the pool refused the batch (a domain no function scores)", _ERROR
                    ),
                },
            }
        },
        "/health": {
            "get": {
                "summary": "Liveness",
                "responses": {"200": _reply("up", {"$ref": "#/components/schemas/Health"})},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": {"description": "the OpenAPI document"}},
            }
        },
    },
    "components": {"schemas": SCHEMAS},
}
"""The document ``GET /openapi.json`` returns."""
