"""The jobs the CLI runs: ``train`` (SFT warm-up, RL, evaluation), ``sft``, ``dpo``, ``inspect``
and ``reward-check``, and the RL loop they drive."""
