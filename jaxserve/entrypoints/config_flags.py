"""Command-line flags from the config tree (`jaxserve.config`), and back.

One `--long-name` per leaf field, vLLM's names, help text from the field; `--config FILE.yaml`
reads the same names as YAML keys. The command line wins over the file, the file over the
defaults. Used by every `jaxserve` command that takes engine settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Sequence
from typing import Any

from jaxserve.config import iter_leaf_fields, load_yaml, set_flat

_SECTION_TITLES = {
    "ModelConfig": "model", "CacheConfig": "KV cache", "SchedulerConfig": "scheduler",
    "ParallelConfig": "parallelism", "RunnerConfig": "runner", "ServerConfig": "HTTP server",
    "StructuredOutputsConfig": "structured outputs", "SpeculativeConfig": "speculative decoding",
}


@functools.cache
def _type_hints(section_type: type) -> dict[str, Any]:
    return typing.get_type_hints(section_type)


def _field_kind(section: Any, field: dataclasses.Field) -> tuple[type, bool]:
    """(scalar type, is_list) of a config field, from its resolved annotation: ``X | None``
    is X, ``list[X]`` is (X, True), a dict is dict, anything else is read as a string."""
    hint = _type_hints(type(section))[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    origin = typing.get_origin(hint) or hint
    if origin is list:
        return typing.get_args(hint)[0], True
    if origin is dict:
        return dict, False
    return (hint if hint in (bool, int, float) else str), False


def add_config_flags(parser: argparse.ArgumentParser, config: Any,
                     skip: Sequence[str] = (), vllm_groups: bool = False) -> None:
    """One flag per leaf field of `config`, grouped by section (with `vllm_groups`, a flag
    vLLM also has sits in vLLM's --help section: ModelConfig, CacheConfig, Frontend...).
    Defaults are SUPPRESSed so that only flags given on the command line appear in the
    parsed namespace."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    vllm_group = _vllm_group_of() if vllm_groups else {}
    for section, name, field in iter_leaf_fields(config):
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        title = vllm_group.get(flag) or \
            _SECTION_TITLES.get(type(section).__name__, type(section).__name__) + " options"
        # vLLM's ungrouped flags sit in argparse's own "options" section, as there.
        group = parser if title == "options" else groups.get(title) or groups.setdefault(
            title, parser.add_argument_group(title))
        meta = dict(field.metadata)
        help_text = meta.pop("help", "")
        default = getattr(section, name)
        kind, is_list = _field_kind(section, field)
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            help_text += f" (default: {'on' if default else 'off'})"
        elif kind is dict:       # vLLM's dict-valued flags take JSON (--speculative-config)
            kwargs["type"] = _json_object
            kwargs["metavar"] = "JSON"
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = name.split("_")[-1].upper() if "choices" not in meta else None
            if is_list:
                kwargs["nargs"] = meta.pop("nargs", "+")
            meta.pop("nargs", None)
            kwargs.update(meta)
            if default is not None:
                help_text += f" (default: {default})"
        if "choices" in kwargs and kwargs.get("metavar") is None:
            kwargs.pop("metavar")
        group.add_argument(flag, help=help_text, **kwargs)


@functools.cache
def _vllm_group_of() -> dict[str, str]:
    """vLLM's --help section of each of its serve flags (and aliases): "ModelConfig"..."""
    from jaxserve.entrypoints.vllm_compat import RENAMED, vllm_flags

    groups = {}
    for flag in vllm_flags()[1]:
        for name in (flag.flag, *flag.aliases):
            groups[RENAMED.get(name, name)] = flag.group
    return groups


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def config_from_args(config: Any, args: argparse.Namespace,
                     vllm_keys: bool = False) -> Any:
    """Defaults ← `--config` YAML ← flags given on the command line. With `vllm_keys`
    (serve) the YAML's vLLM keys are settled as vLLM flags are on the command line; the
    warnings for accepted ones join `args.vllm_warnings`."""
    if getattr(args, "config", None):
        values = load_yaml(args.config)
        if vllm_keys:
            from jaxserve.entrypoints.vllm_compat import translate_config_keys

            leaves = [name for _, name, _ in iter_leaf_fields(config)]
            translated = translate_config_keys(values, leaves, args.config)
            values = translated.values
            args.vllm_warnings = [*getattr(args, "vllm_warnings", []), *translated.warnings]
        try:
            set_flat(config, values)
        except TypeError as exc:
            raise ValueError(f"{args.config}: {exc}") from None
        _check_types(config, values, args.config)
    leaves = {name for _, name, _ in iter_leaf_fields(config)}
    set_flat(config, {k: v for k, v in vars(args).items() if k in leaves})
    return config


def _check_types(config: Any, values: dict[str, Any], source: str) -> None:
    """YAML values must have their field's type (an int may stand for a float)."""
    fields = {name: (section, field) for section, name, field in iter_leaf_fields(config)}
    for name, value in values.items():
        if value is None:
            continue
        kind, is_list = _field_kind(*fields[name])
        items = value if is_list and isinstance(value, list) else [value]
        allowed = (int, float) if kind is float else (kind,)
        if any(not isinstance(v, allowed) or (kind is not bool and isinstance(v, bool))
               for v in items):
            raise ValueError(f"{source}: {name.replace('_', '-')} must be "
                             f"{'a list of ' if is_list else ''}{kind.__name__}, got {value!r}")
        choices = fields[name][1].metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{source}: {name.replace('_', '-')} must be one of {choices}, "
                             f"got {value!r}")


def config_to_yaml(config: Any) -> str:
    """The config as YAML with long flag names as keys (what `--config` reads)."""
    import yaml

    data = {name.replace("_", "-"): getattr(section, name)
            for section, name, _ in iter_leaf_fields(config)}
    return yaml.safe_dump(data, sort_keys=False)
