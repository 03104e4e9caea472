"""Multi-turn rollouts: the pieces an episode of tool use or an environment is built from.

So far:

- :mod:`~treadle.rollout.environments.tool_calls`: an assistant turn's text -> its reasoning,
  its reply and its tool calls (Hermes/Qwen ``<tool_call>`` format); never raises on what a
  policy writes.
- :mod:`~treadle.rollout.environments.tools`: typed Python functions as tools (JSON schemas for
  the chat template; calls concurrent in a bounded pool, each under a timeout; never raise).

Not yet: the environment Protocol, the token-in-token-out trajectory builder and the episode
loop on the per-request engine (issue 14 of the tracker).
"""
