"""Multi-turn rollouts: the pieces an episode of tool use or an environment is built from.

So far: :mod:`~treadle.rollout.environments.tool_calls`, the parser of an assistant turn's text
into its reasoning, its reply and its tool calls (Hermes/Qwen ``<tool_call>`` format), which
never raises on what a policy writes.
"""
