"""The ``environment`` section: multi-turn episodes instead of single completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from treadle.config.fields import above, at_least, bounded


@dataclass
class EnvironmentConfig:
    """Multi-turn rollouts: each sample is an episode of the policy and an environment
    (:mod:`treadle.rollout.environments`), or of an outside agent (``agent``). Off when both
    are empty (one completion per sample)."""

    @property
    def enabled(self) -> bool:
        """Whether samples are episodes (an environment or an agent is named)."""
        return bool(self.name or self.agent)

    name: str = ""
    """A registered environment (e.g. ``calculator``) or an import path
    ``package.module:Class`` of a factory called with ``kwargs`` once per episode."""
    kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Keyword arguments of the factory."""
    agent: str = ""
    """Instead of ``name``: an outside agent, the import path ``package.module:function`` of
    ``agent(base_url, messages) -> answer``, run once per episode with an OpenAI client pointed
    at treadle's endpoint (:mod:`treadle.rollout.environments.agent_server`)."""
    history: Literal["as_sampled", "split"] = "as_sampled"
    """How a template that is not prefix-stable is handled (see
    :mod:`treadle.rollout.environments.trajectory`); the loop trains ``as_sampled`` so far."""
    max_turns: int = bounded(at_least(1), default=4)
    """Assistant turns of one episode."""
    max_tokens: int = bounded(at_least(1), default=512)
    """Tokens of an episode's whole context; each turn samples what is left, at most
    ``rollout.max_tokens``."""
    max_observation_tokens: int = bounded(at_least(1), default=256)
    """Tokens of one environment message; longer ones are cut and marked."""
    step_timeout_s: float = bounded(above(0.0), default=30.0)
    """Seconds the environment may take to answer one turn."""
    episode_timeout_s: float = bounded(above(0.0), default=300.0)
    """Seconds of one episode, generation included."""
    overlong: Literal["keep", "mask", "zero_reward"] = "keep"
    """An episode out of turns or tokens: trained as it is, not trained, or rewarded 0."""
    max_concurrent: int = bounded(at_least(1), default=256)
    """Episodes running at once."""
    tool_timeout_s: float = bounded(above(0.0), default=10.0)
    """Seconds one tool call may take (tool environments)."""
    tool_threads: int = bounded(at_least(1), default=4)
    """Threads running tool calls and synchronous environments, over all episodes."""
