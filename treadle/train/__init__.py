"""The policy-update stage: the single-process PyTorch training backend, padding-free packing of
flat samples into micro-batches, the objectives that glue the pure loss functions to a backend's
forward pass, and the in-process weight sync to an engine in the same process."""
