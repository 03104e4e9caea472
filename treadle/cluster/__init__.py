"""Beyond one process: Ray placement, the trainer group (FSDP2, ZeRO or Megatron TP ranks), the
engine group, weight sync.

``placement.mode`` picks the layout; the RL loop is the same in every mode: it drives a
:class:`~treadle.core.protocols.TrainingBackend` (here the trainer group), an
:class:`~treadle.core.protocols.InferenceEngine` (the engine group) and a
:class:`~treadle.core.protocols.WeightSync` (a Ray transport). Ray is imported only in the Ray
modes, and this package only by them.
"""

from __future__ import annotations

from pathlib import Path


def build_ray_roles(cfg, spec, version: int, run_dir: Path):
    """Place the roles of ``cfg.placement`` and start them: ``(trainer group, engine group,
    weight sync)``. The weights in ``spec.model_dir`` are policy ``version``. Call
    :func:`check_environment` first.

    Raises:
        UserError: the cluster cannot hold the bundles.
    """
    from treadle.cluster.engine_group import EngineGroup
    from treadle.cluster.placement import place
    from treadle.cluster.trainer_group import TrainerGroup
    from treadle.cluster.transports import RaySync

    p = cfg.placement
    placement = place(p)
    trainers = TrainerGroup(
        p,
        placement,
        spec.model_dir,
        cfg.trainer,
        cfg.run.steps * cfg.trainer.mini_batches,
        cfg.rollout.temperature,
    )
    engines = EngineGroup(
        cfg.rollout.engine,
        spec,
        placement,
        p.threads,
        p.engine_restarts,
        version=version,
        trainers=trainers,  # a restarted engine worker gets the current weights from them
        bucket_mb=p.bucket_mb,
    )
    transport = p.weight_sync
    if transport == "auto":
        transport = "shared_memory" if p.mode == "colocated" else "collective"
    sync = RaySync(
        transport,
        trainers,
        engines,
        cfg.rollout.dtype,
        p.bucket_mb,
        disk_dir=run_dir / "weight_sync",
    )
    return trainers, engines, sync


def build_ray_models(cfg, trainers, start: Path, ckpt: Path | None):
    """The KL reference (``algorithm.kl.coef > 0``) and PPO's critic (``algorithm.advantage=gae``)
    on the trainer group's ranks, each held as the policy is (verl's colocated actor,
    reference and critic): ``(reference or None, critic or None)``, as
    :func:`treadle.jobs.compose.build_reference` and ``build_critic`` give in one process. The
    critic starts from the checkpoint being resumed (its weights and optimizer state), else
    from ``start`` with a value head seeded by ``run.seed``.

    Raises:
        UserError: the checkpoint's critic state does not fit.
    """
    import dataclasses

    from treadle.store.checkpoint import CRITIC_DIRNAME, load_critic_state

    reference = critic = None
    if cfg.algorithm.kl.coef > 0:
        reference = trainers.add_model("reference", start, cfg.trainer, 1, False, "lm")
    if cfg.algorithm.advantage == "gae":
        trainer = dataclasses.replace(cfg.trainer, lr=cfg.algorithm.critic.lr)
        folder = ckpt / CRITIC_DIRNAME if ckpt else start
        steps = cfg.run.steps * cfg.trainer.mini_batches
        critic = trainers.add_model("critic", folder, trainer, steps, True, "value", cfg.run.seed)
        if ckpt:
            load_critic_state(ckpt, critic)
    return reference, critic


def check_environment(cfg) -> None:
    """What the machine must offer ``cfg.placement`` (checked before a run directory exists).

    Raises:
        UserError: a Ray mode without Ray installed, or GPU bundles / NCCL where no GPU is
            visible (a local Ray would invent the GPUs and the workers would fail later).
    """
    import importlib.util
    import os

    import torch

    from treadle.core.errors import UserError

    p = cfg.placement
    if p.mode == "single":
        return
    if importlib.util.find_spec("ray") is None:
        raise UserError(
            f"placement.mode={p.mode} needs Ray: pip install 'treadle[ray]' (scripts/install.sh "
            "does), or set placement.mode=single"
        )
    wants_gpu = p.trainer_gpus > 0 or p.engine_gpus > 0 or p.backend == "nccl"
    if wants_gpu and not torch.cuda.is_available() and not os.environ.get("RAY_ADDRESS"):
        raise UserError(
            "placement: trainer_gpus/engine_gpus > 0 or backend=nccl, but no GPU is visible "
            "here; set them to 0 and backend=auto on a CPU machine (or set RAY_ADDRESS to a "
            "cluster with GPUs)"
        )


def close_ray_roles(trainers, engines) -> None:
    """Stop the workers and release the placement group (Ray itself keeps running)."""
    trainers.close()
    engines.close()
    engines.placement.remove()
