"""Fill ``cases.json``'s peer values by running the peers' own code at the pinned commits.

Not a test: the conformance test reads the values this writes. Rerun it when a row is added or
a peer is re-pinned (check out each peer at the commit ``cases.json`` names, then):

    .venv/bin/python -m tests.conformance.peer_values \\
        --verl PATH/verl --trl PATH/trl --openrlhf PATH/OpenRLHF

Each peer entry's ``args`` are the peer's own parameters for the call. ``origin: function``
entries call the peer's function (imported from its source tree; heavy imports it does not need
for the math, such as flash-attn, are stubbed); ``origin: transcribed`` entries re-type the cited
lines, where the peer computes the value inline in a trainer method. Nothing here is used by
treadle itself.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import re
import sys
import types
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

CASES = Path(__file__).with_name("cases.json")
STUBBED = ("torchdata", "flash_attn", "ring_flash_attn", "vllm", "deepspeed", "liger_kernel")


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``STUBBED`` packages give empty modules whose attributes are dummies."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (), {})  # any name imports
        return module

    def exec_module(self, module):
        return None


def _t(x, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def _on_mask(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(v) for v in x[mask.bool()]]


def _token_level_rewards(inp) -> torch.Tensor:
    """Outcome on each sample's last trained token plus the per-token rewards (verl's form)."""
    mask = _t(inp["mask"])
    out = _t(inp["token_rewards"]) * mask if "token_rewards" in inp else torch.zeros_like(mask)
    for b, r in enumerate(inp["rewards"]):
        last = int(mask[b].nonzero().max())
        out[b, last] += r
    return out


# ---------------------------------------------------------------- verl


def verl_values(root: Path, rows) -> None:
    sys.path.insert(0, str(root))
    import transformers

    if not hasattr(transformers, "AutoModelForVision2Seq"):  # removed in transformers 5
        transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    from verl.workers.config import ActorConfig

    def actor_config(args):
        cfg = ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            clip_ratio=args["clip_ratio"],
            clip_ratio_low=args.get("clip_ratio_low", args["clip_ratio"]),
            clip_ratio_high=args.get("clip_ratio_high", args["clip_ratio"]),
            clip_ratio_c=args.get("clip_ratio_c", 3.0),
        )
        return cfg

    def advantage(inp, args, want="advantages"):
        mask, tlr = _t(inp["mask"]), _token_level_rewards(inp)
        index = np.array(inp["groups"])
        est = args["estimator"]
        if est == "grpo":
            adv, ret = core_algos.compute_grpo_outcome_advantage(
                tlr, mask, index, 1e-6, args.get("norm_adv_by_std_in_grpo", True)
            )
        elif est == "rloo":
            adv, ret = core_algos.compute_rloo_outcome_advantage(tlr, mask, index)
        elif est == "reinforce_plus_plus":
            config = SimpleNamespace(gamma=inp.get("gamma", 1.0))
            adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
                tlr, mask, config=config
            )
        elif est == "reinforce_plus_plus_baseline":
            adv, ret = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
                tlr, mask, index
            )
        elif est == "remax":
            adv, ret = core_algos.compute_remax_outcome_advantage(tlr, _t(inp["baselines"]), mask)
        elif est == "gae":
            adv, ret = core_algos.compute_gae_advantage_return(
                tlr, _t(inp["values"]), mask, inp["gamma"], inp["lam"]
            )
        else:
            raise ValueError(est)
        return _on_mask(ret if want == "returns" else adv, mask)

    def policy_loss(inp, args):
        mask = _t(inp["mask"])
        fn = core_algos.get_policy_loss_fn(args.get("loss_mode", "vanilla"))
        loss, _ = fn(
            _t(inp["old_logprobs"]),
            _t(inp["logprobs"]),
            _t(inp["advantages"]),
            mask,
            loss_agg_mode=args["loss_agg_mode"],
            config=actor_config(args),
        )
        return [float(loss)]

    def aggregation(inp, args):
        loss = core_algos.agg_loss(
            _t(inp["loss"]),
            _t(inp["mask"]),
            args["loss_agg_mode"],
            loss_scale_factor=args.get("loss_scale_factor"),
        )
        return [float(loss)]

    def kl(inp, args):
        out = core_algos.kl_penalty(
            _t(inp["logprobs"]), _t(inp["ref_logprobs"]), args["kl_penalty"]
        )
        return [float(v) for v in out]

    def importance_sampling(inp, args):
        mask, old, behavior = _t(inp["mask"]), _t(inp["old_logprobs"]), _t(inp["behavior_logprobs"])
        c = inp["C"]
        if "rollout_rs" in args:
            weights, mask_kept, _ = (
                rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
                    old_log_prob=old,
                    rollout_log_prob=behavior,
                    response_mask=mask,
                    rollout_is=args["rollout_is"],
                    rollout_is_threshold=c,
                    rollout_rs=args["rollout_rs"],
                    rollout_rs_threshold=f"{1 / c}_{c}",
                )
            )
            w = weights.batch["rollout_is_weights"]
        else:
            w, _ = rollout_corr_helper.compute_rollout_correction_weights(
                old - behavior, mask, args["rollout_is"], c
            )
            mask_kept = mask
        return [float(core_algos.agg_loss(_t(inp["loss"]) * w, mask_kept, "token-mean"))]

    def entropy(inp, args):
        agg = core_algos.agg_loss(_t(inp["entropy"]), _t(inp["mask"]), args["loss_agg_mode"])
        return [inp["coef"] * float(agg)]

    kinds = {
        "advantage": advantage,
        "returns": lambda i, a: advantage(i, a, "returns"),
        "policy_loss": policy_loss,
        "aggregation": aggregation,
        "kl": kl,
        "importance_sampling": importance_sampling,
        "entropy": entropy,
    }
    _fill(rows, "verl", kinds)


# ---------------------------------------------------------------- TRL


def trl_values(root: Path, rows) -> None:
    sys.path.insert(0, str(root))
    from trl.trainer.grpo_trainer import GRPOTrainer

    def compute_loss(args, mask, logps, old, advantages, entropies=None, ref=None):
        """``GRPOTrainer._compute_loss`` on a stand-in trainer: the model's logprobs and
        entropies are given instead of computed; one process, no gradient accumulation."""
        b, t = mask.shape
        entropies = torch.zeros_like(logps) if entropies is None else entropies
        coef = args.get("entropy_coef", 0.0)
        trainer = SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
            aux_loss_enabled=False,
            top_entropy_quantile=1.0,
            off_policy_mask_threshold=None,
            importance_sampling_level=args.get("importance_sampling_level", "token"),
            beta=args.get("beta", 0.0),
            args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
            loss_type=args["loss_type"],
            epsilon_low=args.get("epsilon", 0.2),
            epsilon_high=args.get("epsilon_high", args.get("epsilon", 0.2)),
            use_vllm=False,
            model=SimpleNamespace(training=True),
            current_gradient_accumulation_steps=1,
            max_completion_length=args.get("max_completion_length", t),
            accelerator=SimpleNamespace(
                num_processes=1,
                process_index=0,
                sync_gradients=True,
                gather=lambda x: x,
                gather_for_metrics=lambda x: x,
                reduce=lambda x, reduction="sum": x,
            ),
            _entropy_bonus_enabled=coef != 0,
            entropy_coef=coef,
            use_adaptive_entropy=False,
            _metrics={"train": defaultdict(list)},
        )
        inputs = {
            "prompt_ids": torch.zeros(b, 0, dtype=torch.long),
            "prompt_mask": torch.zeros(b, 0, dtype=torch.long),
            "completion_ids": torch.zeros(b, t, dtype=torch.long),
            "completion_mask": mask,
            "advantages": advantages,
            "old_per_token_logps": old,
            "num_items_in_batch": mask.sum(),
        }
        if ref is not None:
            inputs["ref_per_token_logps"] = ref
        return float(GRPOTrainer._compute_loss(trainer, None, inputs))

    def advantage(inp, args):
        # trl/trainer/grpo_trainer.py L2683-L2707, re-typed (one reward function, weight 1)
        rewards = _t(inp["rewards"])
        n = len(inp["rewards"]) // (max(inp["groups"]) + 1)
        mean = rewards.view(-1, n).mean(dim=1).repeat_interleave(n)
        std = rewards.view(-1, n).std(dim=1).repeat_interleave(n)  # trl's nanstd is unbiased
        adv = rewards - mean
        if args["scale_rewards"] != "none":
            adv = adv / (std + 1e-4)
        mask = _t(inp["mask"])
        return _on_mask(adv[:, None] * mask, mask)

    def policy_loss(inp, args):
        mask = _t(inp["mask"])
        loss = compute_loss(
            args, mask, _t(inp["logprobs"]), _t(inp["old_logprobs"]), _t(inp["advantages"])
        )
        return [loss]

    def aggregation(inp, args):
        # with logp == old the ratio is 1 and the per-token loss is -advantage
        mask, lp = _t(inp["mask"]), torch.zeros(_t(inp["mask"]).shape)
        return [compute_loss(args, mask, lp, lp, -_t(inp["loss"]))]

    def kl(inp, args):
        # one token at a time: dapo's token-mean of one token is its beta * k3
        out = []
        for lp, ref in zip(inp["logprobs"], inp["ref_logprobs"], strict=True):
            one = torch.ones(1, 1)
            z = torch.zeros(1, 1)
            out.append(compute_loss(args, one, _t([[lp]]), _t([[lp]]), z, ref=_t([[ref]])))
        return out

    def importance_sampling(inp, args):
        # L2579-L2620, re-typed: the ratio old / sampling, truncated or masked
        mask = _t(inp["mask"])
        diff = (_t(inp["old_logprobs"]) - _t(inp["behavior_logprobs"])) * mask
        mode, c = args["mode"], inp["C"]
        if mode.startswith("sequence"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        if mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=args.get("clip_min"), max=c)
        else:
            low = args.get("clip_min", -float("inf"))
            ratio = ratio.masked_fill((ratio < low) | (ratio > c), 0.0)
        per_token = _t(inp["loss"]) * ratio  # L3117-L3118, then dapo's token normaliser
        return [float((per_token * mask).sum() / mask.sum())]

    def entropy(inp, args):
        mask = _t(inp["mask"])
        zeros = torch.zeros(mask.shape)
        loss = compute_loss(
            args | {"entropy_coef": inp["coef"]},
            mask,
            zeros,
            zeros,
            zeros,
            entropies=_t(inp["entropy"]),
        )
        return [-loss]  # the policy term is 0: loss = -coef * entropy term

    def off_policy_mask(inp, args):
        mask = _t(inp["mask"])
        keep = GRPOTrainer.get_off_policy_mask(
            advantages=_t(inp["advantages"])[:, None],
            per_token_logps=_t(inp["logprobs"]),
            sampling_per_token_logps=_t(inp["behavior_logprobs"]),
            mask=mask,
            off_policy_threshold=args["off_policy_threshold"],
        )
        return _on_mask(keep.expand_as(mask), mask)

    kinds = {
        "advantage": advantage,
        "policy_loss": policy_loss,
        "aggregation": aggregation,
        "kl": kl,
        "importance_sampling": importance_sampling,
        "entropy": entropy,
        "off_policy_mask": off_policy_mask,
    }
    _fill(rows, "trl", kinds)


# ---------------------------------------------------------------- OpenRLHF


def openrlhf_values(root: Path, rows) -> None:
    sys.path.insert(0, str(root))
    sys.meta_path.insert(0, _Stubs())
    from openrlhf.models.loss import PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    def advantage(inp, args, want="advantages"):
        mask = _t(inp["mask"])
        groups = inp["groups"]
        n = len(groups) // (max(groups) + 1)
        estimator = args["estimator"]
        cli = SimpleNamespace(
            rollout=SimpleNamespace(n_samples_per_prompt=n),
            algo=SimpleNamespace(
                advantage=SimpleNamespace(
                    estimator=estimator,
                    gamma=inp.get("gamma", 1.0),
                    lambd=inp.get("lam", 1.0),
                    no_std_norm=False,
                )
            ),
            reward=SimpleNamespace(
                clip_range=None, overlong_buffer_len=None, stop_properly_penalty_coef=None
            ),
        )
        maker = SimpleNamespace(
            strategy=SimpleNamespace(args=cli),
            kl_ctl=SimpleNamespace(value=1.0),
            advantage_estimator=estimator,
        )
        maker.get_advantages_and_returns = lambda *a: (
            RemoteExperienceMaker.get_advantages_and_returns(maker, *a)
        )
        maker.get_cumulative_returns = lambda *a: RemoteExperienceMaker.get_cumulative_returns(
            maker, *a
        )
        token_rewards = (
            _t(inp["token_rewards"]) if "token_rewards" in inp else torch.zeros(mask.shape)
        )
        experience = SimpleNamespace(
            index=list(range(len(groups))),
            rewards=_t(inp["rewards"]),
            kl=-token_rewards,  # compute_reward adds -kl_coef * kl, kl_coef 1
            action_mask=mask.bool(),
            values=_t(inp["values"]) if "values" in inp else None,
            info={},
            response_length=mask.sum(-1),
            prompts=[""] * len(groups),
        )
        (out,) = RemoteExperienceMaker.compute_advantages_and_returns(maker, [experience])
        return _on_mask(out.returns if want == "returns" else out.advantages, mask)

    def policy_loss(inp, args):
        fn = PolicyLoss(
            clip_eps_low=args["clip"][0],
            clip_eps_high=args["clip"][1],
            dual_clip=args.get("dual_clip"),
            token_level_loss=args.get("token_level_loss", True),
            policy_loss_type=args.get("policy_loss_type", "ppo"),
        )
        loss = fn(
            _t(inp["logprobs"]),
            _t(inp["old_logprobs"]),
            _t(inp["advantages"]),
            action_mask=_t(inp["mask"]),
        )[0]
        return [float(loss)]

    def aggregation(inp, args):
        return [float(aggregate_loss(_t(inp["loss"]), _t(inp["mask"]), args["token_level_loss"]))]

    def kl(inp, args):
        out = compute_approx_kl(_t(inp["logprobs"]), _t(inp["ref_logprobs"]), args["kl_estimator"])
        return [float(v) for v in out]

    def importance_sampling(inp, args):
        fn = PolicyLoss(
            enable_vllm_is_correction=True,
            vllm_is_truncated_threshold=args["thresholds"],
            vllm_is_correction_type=args["correction"],
        )
        old = _t(inp["old_logprobs"])
        # logp == old: ratio 1, so the per-token loss is -advantage = the given loss
        loss = fn(
            old,
            old,
            -_t(inp["loss"]),
            action_mask=_t(inp["mask"]),
            rollout_log_probs=_t(inp["behavior_logprobs"]),
        )[0]
        return [float(loss)]

    def entropy(inp, args):
        agg = aggregate_loss(_t(inp["entropy"]), _t(inp["mask"]), args["token_level_loss"])
        return [inp["coef"] * float(agg)]

    kinds = {
        "advantage": advantage,
        "returns": lambda i, a: advantage(i, a, "returns"),
        "policy_loss": policy_loss,
        "aggregation": aggregation,
        "kl": kl,
        "importance_sampling": importance_sampling,
        "entropy": entropy,
    }
    _fill(rows, "openrlhf", kinds)


def _fill(rows, name, kinds) -> None:
    for row in rows:
        entry = row["peers"].get(name)
        if entry is not None:
            entry["value"] = [round(v, 9) for v in kinds[row["kind"]](row["inputs"], entry["args"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", type=Path, required=True)
    parser.add_argument("--trl", type=Path, required=True)
    parser.add_argument("--openrlhf", type=Path, required=True)
    args = parser.parse_args()
    doc = json.loads(CASES.read_text())
    torch.set_default_dtype(torch.float32)
    verl_values(args.verl, doc["rows"])
    trl_values(args.trl, doc["rows"])
    openrlhf_values(args.openrlhf, doc["rows"])
    CASES.write_text(dump(doc))


def dump(doc) -> str:
    """JSON with each innermost list on one line (a row of a tensor reads as a row)."""
    text = json.dumps(doc, indent=1)
    return (
        re.sub(
            r"\[\s*([-0-9.eE, \s]+?)\s*\]",
            lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
            text,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
