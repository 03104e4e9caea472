"""What a run reads and writes: datasets and the task sampler, model folders, the rollout buffer,
checkpoints, metrics files, progress and reports."""
