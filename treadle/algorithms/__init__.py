"""RL algorithms as pure tensor functions: advantage estimators, policy losses, KL, aggregation."""
