"""The rollout stage: inference engines, generation and scoring of groups, evaluation sampling,
and the step from scored groups to trainable samples."""
