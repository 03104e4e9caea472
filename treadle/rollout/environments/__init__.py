"""Multi-turn rollouts: the pieces an episode of tool use or an environment is built from.

So far:

- :mod:`~treadle.rollout.environments.tool_calls`: an assistant turn's text -> its reasoning,
  its reply and its tool calls (Hermes/Qwen ``<tool_call>`` format); never raises on what a
  policy writes.
- :mod:`~treadle.rollout.environments.tools`: typed Python functions as tools (JSON schemas for
  the chat template; calls concurrent in a bounded pool, each under a timeout; never raise).

- :mod:`~treadle.rollout.environments.trajectory`: token-in-token-out trajectories: sampled ids
  kept verbatim, environment messages rendered as a suffix after the template's glue, every
  token's provenance, version and turn; the two history modes for templates that are not
  prefix-stable, and the template self-check.
- :mod:`~treadle.rollout.environments.base`: the :class:`~.base.Environment` Protocol (async
  reset/step/reward/close), the thread-pool adapter for synchronous environments, ``ToolEnv``,
  and environments found by name or ``package.module:Class``.
- :mod:`~treadle.rollout.environments.episode`: one episode under its budgets (turns, tokens,
  observation size, step and episode timeouts), from any ``sample(context, max_tokens)``.

Not yet: episodes on the rollout scheduler and the training loop, the OpenAI-compatible
endpoint, and the shipped environments (issue 14 of the tracker).
"""
