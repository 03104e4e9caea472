"""What ``treadle simulate`` and ``treadle plan`` read from a treadle run (``--lengths-from
RUN_DIR``): the response and prompt lengths in its buffer, and its roles and forwards from its
config.yaml. Read only."""

from __future__ import annotations

import json
from collections.abc import Collection
from functools import partial
from pathlib import Path
from typing import NamedTuple

from treadle.core.errors import UserError
from treadle.scale.checks import MAX_LORA_RANK


class RunRoles(NamedTuple):
    """What a treadle run's config.yaml makes of a step (:func:`run_roles`)."""

    roles: tuple[str, ...]
    forwards: int
    """Forward passes besides the update's."""
    greedy_baseline: bool = False
    """ReMax (``algorithm.advantage=remax``): a greedy response a prompt, not trained."""
    lora_rank: int = 0
    """``model.lora.r``: LoRA adapters of this rank train the policy; 0: every weight."""
    lora_sync: str = "merged"
    """``model.lora.sync``: what a weight sync sends, merged weights or the adapters alone."""


def run_lengths(run_dir: Path) -> tuple[list[tuple[int, ...]], list[int]]:
    """(response tokens by prompt, prompt tokens) of every rollout in ``run_dir``'s buffer
    (``buffer/step_*.parquet``), read only: one tuple per group (the rows of a step that share
    its ``group`` column; a file without that column gives one tuple per rollout).

    Raises:
        UserError: no buffer there, or a file that is not a readable rollout table.
    """
    import pyarrow.parquet as pq

    files = sorted((run_dir / "buffer").glob("step_*.parquet"))
    if not files:
        raise UserError(
            f"--lengths-from {run_dir}: no buffer/step_*.parquet there; pass the run directory "
            "of a treadle train run (it stores each step's rollouts)"
        )
    odd = next((path for path in files if not path.is_file()), None)
    if odd is not None:  # a FIFO or a device would block the read, a folder fail it
        raise UserError(f"--lengths-from: {odd} is not a regular file; a treadle buffer holds "
                        "only step_*.parquet files")  # fmt: skip
    groups: dict[tuple[int, int], list[int]] = {}
    prompts = []
    for f, path in enumerate(files):
        try:
            schema = pq.read_schema(path)
            columns = ["token_ids", "prompt_tokens"] + (["group"] if "group" in schema.names
                                                        else [])  # fmt: skip
            table = pq.read_table(path, columns=columns).to_pydict()  # refuses a missing column
            ids_type = schema.field("token_ids").type
        except Exception as e:  # pyarrow raises several types for a damaged or foreign file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"--lengths-from: cannot read {path} as rollouts ({first})") from None
        if not _token_list(ids_type):
            raise UserError(f"--lengths-from: {path}: its token_ids are {ids_type}, not lists of "
                            "token ids; is it a treadle buffer?")  # fmt: skip
        ids_, prompt_ = table["token_ids"], table["prompt_tokens"]
        for row, (ids, prompt, group) in enumerate(
            zip(ids_, prompt_, table.get("group", range(len(ids_))), strict=True)
        ):
            if not isinstance(prompt, int) or isinstance(prompt, bool):
                raise UserError(
                    f"--lengths-from: {path} holds a rollout whose prompt_tokens ({prompt!r}) is "
                    "not a whole count of tokens; is it a treadle buffer?"
                )
            if not isinstance(ids, list) or not 0 < prompt < len(ids):
                raise UserError(
                    f"--lengths-from: {path} holds a rollout whose token_ids ({type(ids).__name__}"
                    f") and prompt_tokens ({prompt!r}) leave no response; is it a treadle buffer?"
                )
            key = (f, group if isinstance(group, int) else -1 - row)
            groups.setdefault(key, []).append(len(ids) - prompt)
            prompts.append(prompt)
    if not groups or max(max(g) for g in groups.values()) < 1:
        raise UserError(f"--lengths-from {run_dir}: its buffer holds no response tokens")
    return [tuple(g) for g in groups.values()], prompts


def _token_list(arrow_type) -> bool:
    """Whether a parquet column of ``arrow_type`` holds lists of integers (token ids)."""
    import pyarrow as pa

    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    return any(f(arrow_type) for f in lists) and pa.types.is_integer(arrow_type.value_type)


def run_roles(run_dir: Path, fix: str = "pass --roles (and --extra-forwards) to give the run's "
              "roles instead", given: Collection[str] = ()) -> RunRoles | None:  # fmt: skip
    """The roles, the forwards besides the update's and ReMax's greedy baseline of the treadle
    run in ``run_dir``, as its ``config.yaml`` sets them: a policy and an engine, a reference
    where ``algorithm.kl.coef`` > 0, a critic for ``algorithm.advantage=gae`` and a reward model
    where a ``reward.functions`` entry is ``reward_model``; forwards: the old policy's logprobs
    unless ``algorithm.importance_sampling`` is none, and one for each of the others; a greedy
    response a prompt for ``algorithm.advantage=remax``; ``model.lora.r`` and ``.sync``. Only
    those keys are read (a run saved by another treadle version still answers), less those in
    ``given`` (``"model.lora.r"``, ``"model.lora.sync"``: the command line gives them, so the
    file's are neither read nor checked, and the result holds their defaults). None where the
    run has no config.yaml (a buffer copied alone).

    Raises:
        UserError: a config.yaml that cannot be read, is empty or not a mapping, or holds a bad
            value for one of those keys; the message names the file and ends with ``fix``.
    """
    from treadle.config import load_config
    from treadle.scale.plan import extra_forwards

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    raw = _run_config(path, fix)
    section = partial(_section, path=path, fix=fix)
    algo, reward = section(raw, "algorithm"), section(raw, "reward")
    both = {"model.lora.r", "model.lora.sync"} <= set(given)
    lora = {} if both else section(section(raw, "model"), "lora", "model.lora")
    picked = {"algorithm.kl.coef": section(algo, "kl", "algorithm.kl").get("coef"),
              "algorithm.advantage": algo.get("advantage"),
              "algorithm.importance_sampling": algo.get("importance_sampling"),
              "model.lora.r": lora.get("r"), "model.lora.sync": lora.get("sync")}  # fmt: skip
    picked = {key: value for key, value in picked.items() if key not in given}
    for key, value in picked.items():  # a list or mapping (a YAML alias bomb) is not expanded
        if value is not None and not isinstance(value, str | int | float):
            raise UserError(f"--lengths-from: {path}: {key} is {_kind(value)}, not a "
                            f"value; {fix}")  # fmt: skip
    try:  # each value as JSON text, so its YAML type holds: r: '16' stays a string, refused
        cfg = load_config(None, [f"{k}={json.dumps(v, default=str)}" for k, v in picked.items()
                                 if v is not None])  # fmt: skip
    except UserError as e:
        raise UserError(f"--lengths-from: {path}: {e}; {fix}") from None
    if cfg.model.lora.r > MAX_LORA_RANK:  # refused here, before the line naming the run's roles
        rank = str(cfg.model.lora.r)
        rank = rank if len(rank) < 12 else f"{rank[:6]}... ({len(rank)} digits)"
        raise UserError(f"--lengths-from: {path}: model.lora.r {rank} is above the largest LoRA "
                        f"rank, {MAX_LORA_RANK:,}; {fix}")  # fmt: skip
    functions = reward.get("functions") or []
    if not isinstance(functions, list):
        raise UserError(f"--lengths-from: {path}: reward.functions is "
                        f"{_kind(functions)}, not a list; {fix}")  # fmt: skip
    rewarded = any(isinstance(f, dict) and f.get("name") == "reward_model" for f in functions)
    roles = ("policy", *(["reference"] if cfg.algorithm.kl.coef > 0 else []),
             *(["critic"] if cfg.algorithm.advantage == "gae" else []),
             *(["reward"] if rewarded else []), "engine")  # fmt: skip
    forwards = extra_forwards(roles, old_logprobs=cfg.algorithm.importance_sampling != "none")
    return RunRoles(roles, forwards, cfg.algorithm.advantage == "remax", cfg.model.lora.r,
                    cfg.model.lora.sync)  # fmt: skip


def _run_config(path: Path, fix: str) -> dict:
    """A run's config.yaml as a mapping. Raises UserError (ending with ``fix``) for a file
    that cannot be read, is not YAML, or is empty or not a mapping."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:
        what = " ".join(str(e).split())
        raise UserError(f"--lengths-from: cannot read {path} ({what}); {fix}") from None
    if not raw or not isinstance(raw, dict):
        raise UserError(f"--lengths-from: {path} holds no run config (empty, or not the mapping "
                        f"treadle train writes); {fix}")  # fmt: skip
    return raw


def _section(raw: dict, key: str, dotted: str = "", *, path: Path, fix: str) -> dict:
    """``raw[key]``, a mapping, or an empty one where it is missing or null (the defaults).
    Raises UserError (naming ``path``, the section ``dotted`` and ending with ``fix``) where it
    is something else."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"--lengths-from: {path}: {dotted or key} is {_kind(value)}, "
                        f"not a section; {fix}")  # fmt: skip
    return value


def _kind(value: object) -> str:
    """What a YAML value is, in YAML's words: "an integer", "a mapping" (Python's "a int",
    "a dict" otherwise)."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping"}  # fmt: skip
    return kinds.get(type(value), f"a {type(value).__name__}")
