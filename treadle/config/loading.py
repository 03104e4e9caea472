"""Reading a recipe (with its ``base:`` chain), applying dotted overrides, and building the typed
tree from the raw mapping: every key and type is checked on the way, then :func:`check` runs."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from treadle.config.aliases import hint
from treadle.config.checks import check
from treadle.config.sections import Config
from treadle.core.errors import UserError

logger = logging.getLogger(__name__)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML recipe, apply ``a.b.c=value`` overrides, validate, and build the tree.

    A recipe may start from another: ``base: default.yaml`` (relative to the recipe) loads that
    one first and lays this recipe's keys over it.

    Raises:
        UserError: missing/unparsable recipe, unknown key (with a "did you mean"), wrong type,
            a malformed override, or a value out of its bounds or at odds with another field
            (naming its dotted key).
    """
    raw: dict[str, Any] = _read_recipe(Path(path), ()) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} must look like section.key=value")
        _set_dotted(raw, key.strip(), _Override(value))
    _renamed_dtype(raw)
    cfg = _build(Config, raw, "")
    check(cfg)
    return cfg


def _read_recipe(p: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """A recipe's raw mapping, with its ``base:`` recipe (a path relative to it) merged under it:
    the recipe's own values win, sections merge key by key, lists are replaced whole."""
    if not p.is_file():
        where = f" (the base of {seen[-1]})" if seen else ""
        raise UserError(
            f"recipe {p}{where} does not exist; pass a YAML file such as recipes/default.yaml"
        )
    if p.resolve() in seen:
        raise UserError(f"recipe {p}: its base: chain loops back to itself")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise UserError(f"recipe {p} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise UserError(f"recipe {p} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise UserError(f"recipe {p} must be a mapping of sections (run:, model:, ...)")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise UserError(f"recipe {p}: base must be a recipe path, got {base!r}")
    return _merge(_read_recipe(p.parent / base, (*seen, p.resolve())), raw)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (for ``config.yaml`` in the run directory)."""
    return dataclasses.asdict(cfg)


@dataclass(frozen=True)
class _Override:
    """The text of a command-line value; parsed once its field's type is known, so a string
    field takes the text as written (``{answer}`` stays a string, not a YAML mapping)."""

    text: str

    def resolve(self, tp: Any, path: str) -> Any:
        """The value for a field of type ``tp``: the text itself for a string field, else the
        text read as YAML (``3`` an int, ``[a, b]`` a list, ``null`` None)."""
        text_only = set(typing.get_args(tp)) == {str, type(None)} and self.text not in ("", "null")
        if tp is str or text_only:
            return self.text
        try:
            return yaml.safe_load(self.text) if self.text else None
        except yaml.YAMLError as e:
            raise UserError(f"override {path}={self.text}: not a valid value ({e})") from None


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``raw``'s entry at the dotted ``key``; ``name[i]`` steps into entry ``i`` of a list
    already there (``reward.functions[0].params.bonus=0.5``).

    Raises:
        UserError: a part is a value, not a section; or ``name[i]`` names no such entry.
    """
    node: Any = raw
    *parents, leaf = key.split(".")
    for part in [*parents, leaf]:
        name, index = _indexed(part)
        if part is leaf and index is None:
            node[leaf] = value
            return
        child = node.get(name) if index is not None else node.setdefault(name, {})
        if index is not None:
            if isinstance(child, _Override):  # a list given earlier on the command line
                child = node[name] = child.resolve(list[Any], f"{key}")
            if not isinstance(child, list) or index >= len(child):
                have = len(child) if isinstance(child, list) else 0
                raise UserError(
                    f"override {key}: {name} has {have} entries here, so no [{index}]; set the "
                    f"whole list, e.g. {name}='[...]'"
                )
            if part is leaf:
                child[index] = value
                return
            child = child[index]
        if not isinstance(child, dict):
            raise UserError(f"override {key}: {part} is a value, not a section")
        node = child


def _indexed(part: str) -> tuple[str, int | None]:
    """``functions[2]`` as ``("functions", 2)``; a plain ``name`` as ``(name, None)``."""
    found = re.fullmatch(r"(\w+)\[(\d+)\]", part)
    return (found[1], int(found[2])) if found else (part, None)


def _build(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"config {path or '<root>'}: expected a section (mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise UserError(_unknown_key(dotted, str(key), value, path, list(fields)))
        kwargs[key] = _coerce(hints[key], value, dotted)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = ", ".join(f"{path}.{m}" if path else m for m in missing)
        raise UserError(f"config: missing required key {where}")
    return cls(**kwargs)


def _unknown_key(dotted: str, key: str, value: Any, path: str, fields: list[str]) -> str:
    """The one-line error for the unknown key ``dotted``: a near spelling of a key of its section
    (``trainer.lrr``), else another framework's name for a key (``trainer.learning_rate``, or
    verl's ``actor_rollout_ref.actor.optim.lr`` under the unknown ``actor_rollout_ref``), else
    the closest key of the section, if any, and the section's keys."""
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.5)
    typo = bool(close) and difflib.SequenceMatcher(None, key, close[0]).ratio() >= 0.8
    if not typo:
        for name in (dotted, *_paths_below(value, dotted)):
            said = hint(name)
            if said is not None:
                return f"config: unknown key {name}; {said}"
    suggestion = f"; did you mean {path + '.' if path else ''}{close[0]}?" if close else ""
    return f"config: unknown key {dotted}{suggestion} (valid: {', '.join(fields)})"


def _paths_below(value: Any, path: str) -> list[str]:
    """The dotted paths of every key inside the raw mapping ``value``, depth first."""
    if not isinstance(value, dict):
        return []
    out = []
    for k, v in value.items():
        out += [f"{path}.{k}", *_paths_below(v, f"{path}.{k}")]
    return out


def _renamed_dtype(raw: dict[str, Any]) -> None:
    """``model.dtype`` (the engine's dtype, under its old name) moved to ``rollout.dtype``, with
    one warning: old recipes and old runs' ``config.yaml`` still load.

    Raises:
        UserError: both names are given.
    """
    model = raw.get("model")
    if not isinstance(model, dict) or "dtype" not in model:
        return
    rollout = raw.setdefault("rollout", {})
    if not isinstance(rollout, dict):
        return  # the build names the malformed rollout section
    if "dtype" in rollout:
        raise UserError(
            "config model.dtype is the old name of rollout.dtype; give only rollout.dtype"
        )
    rollout["dtype"] = model.pop("dtype")
    logger.warning(
        "config model.dtype is deprecated: it is the inference engine's dtype, now "
        "rollout.dtype (the trainer keeps fp32 weights; bf16 compute: trainer.bf16_autocast)"
    )


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if isinstance(value, _Override):
        value = value.resolve(tp, path)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        # A member of the value's own type first (a bool of bool | int | str stays a bool, a
        # str "10" stays a str), then each member in order, with its conversions.
        exact = [a for a in args if (typing.get_origin(a) or a) is type(value)]
        for arg in (*exact, *(a for a in args if a is not type(None) and a not in exact)):
            try:
                return _coerce(arg, value, path)
            except UserError as e:
                errors.append(str(e))
        raise UserError(
            errors[-1]
            if len(errors) == 1
            else f"config {path}: expected {_name(tp)}, got {value!r}"
        )
    if origin is Literal:
        if value not in args:
            raise UserError(
                f"config {path}: expected one of {', '.join(map(repr, args))}, got {value!r}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"config {path}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise UserError(f"config {path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(
            _coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"config {path}: expected a mapping, got {value!r}")
        return {str(k): _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    return _scalar(tp, value, path)


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-5" as a string
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if tp in (int, bool, str) and type(value) is tp:
        return value
    raise UserError(f"config {path}: expected {_name(tp)}, got {type(value).__name__} {value!r}")


def _name(tp: Any) -> str:
    """A type as a user reads it: ``'jsonl' | 'parquet' | str``, not ``Union`` (the
    ``__name__`` of a ``typing.Union``)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(repr, typing.get_args(tp)))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
