"""The options of ``treadle plan`` and ``treadle simulate`` (:mod:`.scale_job` runs them):
their names, defaults and help, and the parsers of their numbers."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from treadle.scale.costs import SYNC_METHODS
from treadle.scale.hardware import GPUS
from treadle.scale.plan import DEFAULT_ROLES, MAX_GPUS, ROLES
from treadle.scale.simulate import AUTO_TOLERANCE, MAX_STEPS

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(
    r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf(inity)?|nan)", re.I
)


def _int(text: str) -> int:
    """An option's integer as written in ASCII digits: Python's int() also takes ``8_0`` (80)
    and other scripts' digits, which no one means as a GPU count."""
    if not _INT.fullmatch(text):
        raise ValueError(text)
    return int(text)


def _float(text: str) -> float:
    """An option's number as written in ASCII (as :func:`_int`); inf and nan reach the
    options' own checks, which name them."""
    if not _FLOAT.fullmatch(text):
        raise ValueError(text)
    return float(text)


_int.__name__, _float.__name__ = "int", "float"  # argparse's "invalid int value: '8_0'"


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of ``command`` (plan or simulate)."""
    parser.add_argument("model", help="a named shape (llama3.1-8b, ...) or a model folder")
    parser.add_argument("--gpu", default="h100", help=f"GPU type: {', '.join(GPUS)} (h100)")
    parser.add_argument("--gpus", type=_int, default=8, help=f"GPUs in all, 1..{MAX_GPUS:,} (8)")
    parser.add_argument("--prompts", type=_int, default=64, help="prompts per RL step (64)")
    parser.add_argument("--samples", type=_int, default=8, help="samples per prompt (8)")
    parser.add_argument("--prompt-tokens", type=_int, help="tokens (default 512, or the run's)")
    parser.add_argument("--max-response", type=_int, help="tokens (default 4096)")
    parser.add_argument("--mean-response", type=_float,
                        help="mean of the lognormal response lengths before they are cut at "
                        "--max-response, tokens (default max / 3); treadle simulate prints the "
                        "mean after the cut")  # fmt: skip
    parser.add_argument("--length-sigma", type=_float,
                        help="spread (sigma) of the lognormal response lengths (0.8)")  # fmt: skip
    parser.add_argument("--extra-forwards", type=_int,
                        help="forward passes besides the update's, at the policy's cost "
                        "(default from --roles: 1 for the old policy's logprobs, +1 for a "
                        "reference, +1 for a critic's values, +1 for a reward model's "
                        "scores)")  # fmt: skip
    parser.add_argument("--minibatches", type=_int, default=1,
                        help="optimizer steps an RL step (verl's batch / ppo_mini_batch_size) "
                        "(1)")  # fmt: skip
    parser.add_argument("--reward-seconds", type=_float, default=0.0,
                        help="seconds to score one sample, beside the engines (0)")  # fmt: skip
    parser.add_argument("--offload", action="store_true",
                        help="colocated: the trainer's states go to host memory while the "
                        "engines generate, and back over PCIe for the update (verl's "
                        "param/optimizer offload, NeMo-RL's colocated default)")  # fmt: skip
    parser.add_argument(
        "--lengths-from",
        type=Path,
        metavar="RUN_DIR",
        help="draw response (and prompt) lengths from a treadle run's buffer instead",
    )
    parser.add_argument(
        "--steps",
        type=_int,
        help=f"RL steps simulated, 2..{MAX_STEPS} (default: until the steady-state step time "
        f"is known to {AUTO_TOLERANCE * 100:g}%%, the warm-up dropped)",
    )
    parser.add_argument("--roles",
                        help=f"the roles that hold GPU memory, comma-separated, of: "
                        f"{', '.join(ROLES)} (a policy at least, and an engine to simulate; "
                        "a reference, critic or reward model also runs a forward, see "
                        "--extra-forwards, and a critic is trained beside the policy) "
                        f"(default {','.join(DEFAULT_ROLES)}; with --lengths-from, the run's "
                        "own, and its forwards, from its config.yaml)")  # fmt: skip
    _training_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    if command == "plan":
        _plan_arguments(parser)
    else:
        _simulate_arguments(parser)


class _Spelled(argparse.Action):
    """Stores the value and the option's spelling as typed (``--tp`` or ``--train-tp``) in
    ``namespace.spelled``, so a message names the option the user wrote."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:  # fmt: skip
        """Store ``values`` and the spelling ``option_string``."""
        setattr(namespace, self.dest, values)
        namespace.spelled = {**namespace.spelled, self.dest: option_string}


def _training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of what a step trains and generates, shared by plan and simulate: ReMax's
    greedy baseline, LoRA and activation recompute."""
    parser.add_argument("--greedy-baseline", action=argparse.BooleanOptionalAction,
                        help="ReMax: one greedy response a prompt, generated after the "
                        "samples, scored, not trained; synchronous steps only (default: off, "
                        "or with --lengths-from the run's algorithm.advantage=remax)")  # fmt: skip
    parser.add_argument("--lora-rank", type=_int,
                        help="train the policy's LoRA adapters of this rank, its weights frozen "
                        "in bf16 (a reference is the policy with its adapters disabled: no "
                        "memory, one forward); 0: every weight (default 0, or with "
                        "--lengths-from the run's model.lora.r)")  # fmt: skip
    parser.add_argument("--reward-model", metavar="MODEL",
                        help="the reward role's model, where it is not the policy's: a named "
                        "shape or a local config.json, as MODEL (its memory beside the trainer's "
                        "and its forward's FLOPs; default: the policy's shape)")  # fmt: skip
    parser.add_argument("--lora-sync", choices=("merged", "adapter"),
                        help="what a LoRA weight sync sends: merged bf16 weights, or the fp32 "
                        "adapters alone, which vLLM serves over the base weights (default "
                        "merged, or with --lengths-from the run's model.lora.sync)")  # fmt: skip
    parser.add_argument("--recompute", choices=("none", "selective", "full"),
                        default="selective",
                        help="activation checkpointing of the trained roles: full recomputes "
                        "each layer's forward in the backward pass, one more forward an update "
                        "(verl's enable_gradient_checkpointing, Megatron's recompute "
                        "granularity) (selective)")  # fmt: skip


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``treadle plan``'s own options."""
    parser.add_argument("--tp", "--train-tp", type=_int, dest="tp", action=_Spelled,
                        help="training tensor-parallel degree (simulate's --train-tp)")  # fmt: skip
    parser.add_argument("--pp", "--train-pp", type=_int, dest="pp", action=_Spelled,
                        help="training pipeline stages (simulate's --train-pp)")  # fmt: skip
    parser.add_argument("--sp", "--train-sp", type=_int, dest="sp", action=_Spelled,
                        help="training Ulysses sequence-parallel degree (simulate's "
                        "--train-sp)")  # fmt: skip
    parser.add_argument("--ep", "--train-ep", type=_int, dest="ep", action=_Spelled,
                        help="a MoE model's training expert-parallel degree over the "
                        "data-parallel ranks (simulate's --train-ep; default: in each layout, "
                        "the most that divides the ranks and the experts)")  # fmt: skip
    parser.add_argument("--micro-batch", type=_int, default=1, help="sequences per pass")
    # the spellings typed (_Spelled); no packing: plan's memory takes --micro-batch
    parser.set_defaults(spelled={}, pack_tokens=0)
    parser.add_argument("--plot", help="write memory per GPU by term and role to this PNG")


def _simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """``treadle simulate``'s own options."""
    parser.add_argument("--mode", choices=("sync", "one_step", "async"), default="sync",
                        help="sync (default), one_step or async")  # fmt: skip
    parser.add_argument("--staleness", type=_float, help="eta, for --mode async (default 1)")
    parser.add_argument("--partial", action="store_true", help="partial rollouts")
    parser.add_argument(
        "--drop-stale",
        action="store_true",
        help="drop samples older than the bound at training (treadle's rule; default: the "
        "bound holds at admission, AReaL's)",
    )
    parser.add_argument(
        "--updates-per-sync",
        type=_int,
        default=1,
        help="trainer updates per weight sync, each on --prompts / N groups as they complete "
        "and at least one optimizer step (verl's trigger_parameter_sync_step; disaggregated "
        "only) (1)",
    )
    parser.add_argument("--rollout-gpus", type=_int, help="disaggregated: engines' GPUs")
    parser.add_argument("--engine-tp", type=_int, default=1,
                        help="GPUs an engine spans by tensor parallel (vLLM's "
                        "tensor_parallel_size) (1)")  # fmt: skip
    parser.add_argument("--train-tp", type=_int, default=1, help="trainer's tensor parallel (1)")
    parser.add_argument("--train-pp", type=_int, default=1,
                        help="trainer's pipeline stages: adds the 1F1B bubble (1)")  # fmt: skip
    parser.add_argument("--train-sp", type=_int, default=1,
                        help="trainer's Ulysses sequence parallel: splits each sequence's "
                        "activations, adds all-to-alls (1)")  # fmt: skip
    parser.add_argument("--train-ep", type=_int, default=0,
                        help="trainer's expert parallel over its data-parallel ranks "
                        "(Megatron's expert_model_parallel_size): a MoE model's experts a rank "
                        "holds and where its tokens' all-to-alls go (default: the most that "
                        "divides the ranks and the experts)")  # fmt: skip
    parser.add_argument("--oversample", type=_float, default=0.0,
                        help="extra prompts a step, as a fraction (0.25: 25%% more); a step "
                        "trains the first --prompts groups to complete (0)")  # fmt: skip
    parser.add_argument("--pack-tokens", type=_int, default=0,
                        help="pack sequences into micro-batches of this many tokens (NeMo-RL's "
                        "train_mb_tokens): fewer micro-batches, a larger pipeline bubble "
                        "(default: one sequence a micro-batch)")  # fmt: skip
    parser.add_argument("--sync-method", choices=SYNC_METHODS,
                        help="how the engines get new weights: colocated (each GPU's shard in "
                        "place), broadcast (the model from one trainer GPU, by a ring), "
                        "resharded (each trainer GPU sends its shard), gathered (every GPU "
                        "receives the whole model, as NeMo-RL's Megatron refit) (colocated "
                        "if the engines share the GPUs, else broadcast)")  # fmt: skip
    parser.add_argument("--sync-seconds", type=_float,
                        help="a weight update's seconds as measured on your framework, in place "
                        "of the model of its bytes (default: the model's)")  # fmt: skip
    parser.add_argument("--spec-tokens", type=_int, default=0,
                        help="speculative decoding: draft tokens a decode step proposes, "
                        "with a draft of one layer and the output head (MTP, EAGLE) "
                        "(0: none)")  # fmt: skip
    parser.add_argument("--spec-accept", type=_float,
                        help="chance each draft token is accepted, 0..1 (DeepSeek-V3 reports "
                        "0.85-0.9 for its MTP token); needed with --spec-tokens")  # fmt: skip
    _simulate_output_arguments(parser)


def _simulate_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``treadle simulate``'s options on what it reports: the steps averaged and the plot."""
    parser.add_argument("--average-steps", type=_step_range, metavar="FIRST-LAST",
                        help="average these steps of the --steps simulated, as a benchmark "
                        "of short runs reports them (NeMo-RL's table: 5-9 of 10 steps) "
                        "(default: the steady state, or steps 2..N with --steps N)")  # fmt: skip
    parser.add_argument("--plot", help="write the timeline (engines and trainer) to this PNG")


def _step_range(text: str) -> tuple[int, int]:
    """``FIRST-LAST`` as (first, last), 1 <= first <= last. Raises ArgumentTypeError."""
    match = re.fullmatch(r"([0-9]{1,9})-([0-9]{1,9})", text)
    if not (match and 1 <= int(match[1]) <= int(match[2])):
        shown = text if len(text) <= 40 else f"{text[:40]}..."
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not FIRST-LAST, as 5-9 (1 <= FIRST <= LAST)"
        )
    return int(match[1]), int(match[2])
