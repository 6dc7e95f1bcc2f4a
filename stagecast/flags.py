"""One declaration per flag: a service's options are one dataclass whose fields carry their flags.

A field declared with ``flag`` is a command-line flag: its name (``--max-batch`` from ``max_batch`` unless
given), help, parser type (from the annotation unless given), choices, whether it is required, and its argparse
action.  Three functions use the declaration, so nothing else spells a service flag again::

    @dataclass
    class CoordinatorOptions:
        stages: int = flag(help="number of DiT stages", required=True)
        max_batch: int = flag(8, help="micro-steps per stage forward")
        mtls: MTLS | None = None  # not a flag: the CLI builds it

    add_flags(parser, CoordinatorOptions)            # the service's --flags, defaults from the fields
    opts = from_args(CoordinatorOptions, args)      # the parsed namespace back as the dataclass
    to_argv(opts)                                   # ["--stages", "2"]: a launcher's child command line

``to_argv`` writes only values other than the default (and every required one), so ``from_args(parse(to_argv(o)))
== o``.  A field whose value is itself an options dataclass (``nested``) contributes its own fields' flags.
``HelpFormatter`` prints each default once: after the help, unless the help already says ``default:``, the default
is None or empty, or the flag is a switch.  Fields without ``flag`` (objects a CLI builds, such as ``mtls``) are
left to the code that makes the options.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from stagecast_client.helpformat import HelpFormatter, shows_default  # noqa: F401 - the client verbs' too

_KEY = "stagecast_flag"
_NESTED = "stagecast_flags_of"
_SCALARS = {"int": int, "float": float, "str": str}


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    name: str | None = None  # "--max-batch"; None: from the field's name
    type: Callable[[str], Any] | None = None  # None: int, float or str from the annotation (or the default)
    choices: Sequence[Any] | None = None
    required: bool = False
    # "store_true", "store_false" (``--no-x`` sets the field False), "optional" (``--x`` / ``--no-x``: argparse's
    # BooleanOptionalAction, for a switch on by default that may be turned off), "append"
    action: str | None = None
    metavar: str | None = None
    format: Callable[[Any], str] | None = None  # a value back to its text for ``to_argv`` (None: str, lists joined)


def flag(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    name: str | None = None,
    type: Callable[[str], Any] | None = None,
    choices: Sequence[Any] | None = None,
    required: bool = False,
    action: str | None = None,
    metavar: str | None = None,
    format: Callable[[Any], str] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    meta = {_KEY: Flag(help, name, type, choices, required, action, metavar, format)}
    if default is dataclasses.MISSING and default_factory is dataclasses.MISSING and not required:
        default = None  # a field the command line may leave out (a CLI fills it, e.g. from the environment)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def nested(cls: type) -> Any:
    """A field holding another options dataclass, whose flags are this one's too."""
    return dataclasses.field(default_factory=cls, metadata={_NESTED: cls})


@dataclasses.dataclass(frozen=True)
class _Spec:
    field: dataclasses.Field
    flag: Flag
    dest: str  # the namespace attribute
    path: tuple[str, ...]  # field names from the outer dataclass down to this one

    @property
    def name(self) -> str:
        return self.flag.name or "--" + self.field.name.replace("_", "-")

    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return None if self.field.default is dataclasses.MISSING else self.field.default

    def parser_type(self) -> Callable[[str], Any]:
        if self.flag.type is not None:
            return self.flag.type
        annotation = self.field.type if isinstance(self.field.type, str) else getattr(self.field.type, "__name__", "")
        for part in str(annotation).replace("Optional[", "").replace("]", "").split("|"):
            if part.strip() in _SCALARS:
                return _SCALARS[part.strip()]
        value = self.default()
        return type(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str


def specs(cls: type, *, _path: tuple[str, ...] = ()) -> list[_Spec]:
    """Every flag of ``cls``, nested dataclasses' included, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            out += specs(f.metadata[_NESTED], _path=(*_path, f.name))
        elif _KEY in f.metadata:
            out.append(_Spec(f, f.metadata[_KEY], "_".join((*_path, f.name)), (*_path, f.name)))
    return out


def _select(cls: type, only: Iterable[str] | None, skip: Iterable[str]) -> list[_Spec]:
    chosen = specs(cls)
    names = {s.dest for s in chosen}
    wanted = set(only) if only is not None else names
    unknown = (wanted | set(skip)) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no flags {sorted(unknown)}")
    return [s for s in chosen if s.dest in wanted and s.dest not in set(skip)]


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
) -> list[str]:
    """Add ``cls``'s flags (or the ``only`` ones, less ``skip``, by field name) to ``parser``; returns their
    namespace attributes (the field names; a nested dataclass's are ``outer_inner``)."""
    added = []
    for spec in _select(cls, only, skip):
        kwargs: dict[str, Any] = {"dest": spec.dest, "help": spec.flag.help}
        action = spec.flag.action
        if action in ("store_true", "store_false"):
            kwargs.update(action=action, default=spec.default())
        elif action == "optional":
            kwargs.update(action=argparse.BooleanOptionalAction, default=spec.default())
        else:
            if action is not None:
                kwargs["action"] = action
            kwargs["type"] = spec.parser_type()
            if spec.flag.required:
                kwargs["required"] = True
            else:
                default = spec.default()
                # append adds to the default: give it a fresh list, never the field's tuple
                kwargs["default"] = list(default) if action == "append" else default
            if spec.flag.choices is not None:
                kwargs["choices"] = spec.flag.choices
            else:  # the flag's name, not the field's: --expected-stages EXPECTED_STAGES
                kwargs["metavar"] = spec.flag.metavar or spec.name.lstrip("-").replace("-", "_").upper()
        parser.add_argument(spec.name, **kwargs)
        added.append(spec.dest)
    return added


def from_args(cls: type, args: argparse.Namespace, *, only: Iterable[str] | None = None, **values: Any) -> Any:
    """``cls`` from a parsed namespace (its flags' attributes, or the ``only`` ones) and ``values`` for the rest;
    a value given in ``values`` wins over the namespace."""
    return _build(cls, args, None if only is None else set(only), values, ())


def _build(cls: type, args: argparse.Namespace, only: set[str] | None, values: dict, path: tuple[str, ...]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        dest = "_".join((*path, f.name))
        if not path and f.name in values:
            kwargs[f.name] = values[f.name]
        elif _NESTED in f.metadata:
            kwargs[f.name] = _build(f.metadata[_NESTED], args, only, values, (*path, f.name))
        elif _KEY in f.metadata and (only is None or dest in only) and hasattr(args, dest):
            value = getattr(args, dest)
            kwargs[f.name] = tuple(value) if isinstance(f.default, tuple) and isinstance(value, list) else value
    return cls(**kwargs)


def to_argv(options: Any, *, only: Iterable[str] | None = None, skip: Iterable[str] = ()) -> list[str]:
    """``options``' flags as a command line: every required one and every other one whose value is not the
    default, in declaration order (``only`` / ``skip`` by namespace attribute, as ``add_flags``)."""
    argv: list[str] = []
    for spec in _select(type(options), only, skip):
        value = options
        for name in spec.path:
            value = getattr(value, name)
        argv += _argv(spec, value)
    return argv


def argv_for(cls: type, **values: Any) -> list[str]:
    """The flags of some of ``cls``'s fields (by namespace attribute), without the rest of an options object: e.g.
    ``argv_for(StageOptions, kv_budget_gib=4.0)`` for the extra arguments of every stage; defaults write nothing."""
    chosen = {spec.dest: spec for spec in _select(cls, values, ())}
    return [arg for dest, value in values.items() for arg in _argv(chosen[dest], value)]


def _argv(spec: _Spec, value: Any) -> list[str]:
    if value is None or (not spec.flag.required and value == spec.default()):
        return []
    action = spec.flag.action
    if action in ("store_true", "store_false"):
        return [spec.name]
    if action == "optional":
        return [spec.name if value else "--no-" + spec.name.removeprefix("--")]
    if action == "append":
        return [arg for item in value for arg in (spec.name, _text(spec, item))]
    return [spec.name, _text(spec, value)]


def _text(spec: _Spec, value: Any) -> str:
    if spec.flag.format is not None:
        return spec.flag.format(value)
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def flag_names(cls: type) -> list[str]:
    """``cls``'s flag names (``--max-batch``), nested dataclasses' included: what docs and the chart must know."""
    return [spec.name for spec in specs(cls)]
