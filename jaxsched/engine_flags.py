"""EngineArgs as command-line flags: one flag per field, typed from its annotation, so no command
line drifts from the API. `jaxsched serve`, `generate`, `run-batch` and the bench commands share it."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from jaxsched.config import EngineArgs


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """One flag per EngineArgs field, typed from its annotation, so the CLI never drifts from the API."""
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        t = hints[f.name]
        base = next((a for a in typing.get_args(t) if a is not type(None)), t)
        if base is typing.Any:  # e.g. scheduling_policy: a name on the command line
            base = str
        elif base is int and any(typing.get_origin(a) is typing.Literal for a in typing.get_args(t)):
            base = _count_or_name  # e.g. cpu_reserved_cores: 2 or auto
        if base is bool:
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            default = _COMMAND_DEFAULTS.get(f.name, f.default)
            parser.add_argument(_flag(f.name), dest=f.name, type=base, default=default, help=f"default: {default}")


# the commands' own defaults where they differ from EngineArgs' (the library's): their process is the
# engine's, so it may place its threads ("auto" reserves one core where the model is small for the cores)
_COMMAND_DEFAULTS = {"cpu_reserved_cores": "auto"}


def _count_or_name(value: str) -> int | str:
    """A flag that takes a whole number or a name ("auto"); EngineArgs checks which names."""
    try:
        return int(value)
    except ValueError:
        return value


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})  # model is a positional
