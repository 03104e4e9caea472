"""treadle: RL post-training for LLMs with rollout, reward and policy update as swappable parts."""

__version__ = "0.1.0"
