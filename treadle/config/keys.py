"""Every key of the config tree with its type, default and meaning, read from the dataclasses.

The meaning of a key is the docstring written under its field (a string expression right after
the annotated assignment), read from the class's source with :mod:`ast`; a field a subclass
redeclares without one keeps its parent's. ``treadle config`` prints these rows, and the
"did you mean" of :mod:`treadle.config.loading` checks its aliases against them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from treadle.config.aliases import hint
from treadle.config.sections import Config
from treadle.core.errors import UserError

_MISSING = object()
"""No instance to read a default from."""
_REQUIRED = "required"
"""The default shown for a field that has none (a mixed source's ``source``, ...)."""


@dataclass(frozen=True)
class KeyDoc:
    """One key of the config tree, as ``treadle config`` prints it."""

    key: str
    """Dotted path, ``[i]`` for an item of a list of sections (``data.mix[i].weight``)."""
    type: str
    """The field's type as written in a recipe: ``int``, ``str | None``, ``sync|async``, ..."""
    default: str
    """The default as YAML (``0.0001``, ``null``, ``[]``), or ``required``."""
    doc: str
    """The field's whole docstring, reflowed to one paragraph (``""`` when it has none)."""

    @property
    def text(self) -> str:
        """:attr:`doc` with its reST markup made plain (````x```` and ``:mod:`x``` as ```x```)."""
        return re.sub(r":[a-z]+:`~?([^`]*)`", r"`\1`", self.doc).replace("``", "`")

    @property
    def meaning(self) -> str:
        """The first sentence of :attr:`text`."""
        return first_sentence(self.text)


def config_keys(cls: type = Config, prefix: str = "", defaults: Any = None) -> list[KeyDoc]:
    """Every leaf key of the dataclass ``cls`` (default: the whole tree), in declaration order,
    depth first. A section field adds its section's keys; a list of sections adds a row for the
    list itself and then its item's keys under ``key[i]``.

    Defaults are read from ``defaults``, an instance of ``cls`` (``Config()`` for the whole
    tree), so a section its parent builds with values (``Config.reward``'s functions) shows
    those; without one (an item of a list of sections) a field shows its declared default.
    """
    if defaults is None and cls is Config:
        defaults = Config()
    rows: list[KeyDoc] = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        value = _MISSING if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(tp):
            rows += config_keys(tp, key, None if value is _MISSING else value)
            continue
        default = _default(f) if value is _MISSING else yaml_text(value)
        rows.append(KeyDoc(key, type_name(tp), default, docs.get(f.name, "")))
        item = _section_item(tp)
        if item is not None:
            rows += config_keys(item, f"{key}[i]")
    return rows


def section_names(cls: type = Config, prefix: str = "") -> list[str]:
    """The dotted names of every section and list of sections (``rollout``, ``algorithm.kl``,
    ``data.mix``), in declaration order."""
    names: list[str] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = typing.get_type_hints(cls)[f.name]
        sub = tp if dataclasses.is_dataclass(tp) else _section_item(tp)
        if sub is not None:
            names += [key, *section_names(sub, key if sub is tp else f"{key}[i]")]
    return names


def _section_item(tp: Any) -> type | None:
    """The item class of a ``list[<dataclass>]`` type, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring, for ``cls`` and the classes it inherits from (the nearest
    class that documents a field wins), each reflowed to one paragraph."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_docs(klass))
    return docs


def _own_docs(cls: type) -> dict[str, str]:
    """The docstrings written in ``cls``'s own body, under its annotated fields."""
    (node,) = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls))).body
    assert isinstance(node, ast.ClassDef)
    docs = {}
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def first_sentence(plain: str) -> str:
    """The text up to the first full stop followed by a space or the end (``e.g.``, ``i.e.``,
    ``eq.`` and the dots inside ``a.b`` do not end a sentence)."""
    m = re.search(r"(?<!e\.g)(?<!i\.e)(?<!\bvs)(?<!\beq)\.(\s|$)", plain)
    return plain[: m.start() + 1] if m else plain


def type_name(tp: Any) -> str:
    """``tp`` as a recipe writer reads it: ``int``, ``str | None``, ``list[str]``, and a
    ``Literal`` as its choices joined by ``|`` (``sync|one_step_off|async``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(map(type_name, args))}]"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _default(f: dataclasses.Field) -> str:
    """The field's default written as YAML, or ``required``."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return _REQUIRED
    return yaml_text(value)


def yaml_text(value: Any) -> str:
    """``value`` as one line of YAML flow style (sections as mappings, tuples as lists)."""
    plain = _plain(value)
    if isinstance(plain, str) and plain:
        return repr(plain) if plain != plain.strip() or plain[0] in "{[<&*!|>%@`'\"#" else plain
    text = yaml.safe_dump(plain, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").strip()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def select_keys(name: str | None) -> list[KeyDoc]:
    """The rows ``treadle config NAME`` prints: all of them (``name`` None), one section's
    (``rollout``, ``algorithm.kl``: the section's keys and its subsections'), a list of
    sections' (``data.mix``: its own row, then its item's keys), or one key's
    (``rollout.mode``). An index may be written as a number (``data.mix[0].weight``).

    Raises:
        UserError: ``name`` is neither a section nor a key: one line with the closest names (or
            treadle's key for another framework's name, ``learning_rate`` -> ``trainer.lr``).
    """
    rows = config_keys()
    if name is None:
        return rows
    name = re.sub(r"\[\d+\]", "[i]", name.strip())
    chosen = [r for r in rows if r.key == name or r.key.startswith((f"{name}.", f"{name}[i]."))]
    if chosen:
        return chosen
    said = hint(name)
    if said is None:
        names = [*section_names(), *(r.key for r in rows)]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        top = ", ".join(f.name for f in dataclasses.fields(Config))
        said = f"did you mean {close[0]}?" if close else f"the sections are {top}"
    raise UserError(f"config: no section or key {name}; {said}")
