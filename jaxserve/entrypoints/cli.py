"""`jaxserve serve [MODEL]`, `jaxserve chat [MODEL]`, `jaxserve convert MODEL OUT` and
`jaxserve export-tokenizer OUT_DIR`.

Flags are generated from the config tree (`jaxserve.config`): one `--long-name`
per leaf field, vLLM's names, help text from the field. `--config FILE.yaml`
reads the same names as YAML keys; the command line wins over the file, the
file over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from jaxserve.config import EngineConfig, ServeConfig, iter_leaf_fields, load_yaml, set_flat

logger = logging.getLogger("jaxserve.cli")

_SECTION_TITLES = {
    "ModelConfig": "model", "CacheConfig": "KV cache", "SchedulerConfig": "scheduler",
    "ParallelConfig": "parallelism", "RunnerConfig": "runner", "ServerConfig": "HTTP server",
    "StructuredOutputsConfig": "structured outputs", "SpeculativeConfig": "speculative decoding",
}

_DESCRIPTION = """\
jaxserve: a JAX/XLA LLM serving engine (paged KV cache, continuous batching,
prefix caching) with an OpenAI-compatible API.

  jaxserve serve                      serve the embedded SmolLM2-135M-Instruct on :8000
  jaxserve serve /models/Qwen3-0.6B   serve a Hugging Face model directory
  jaxserve serve --config configs/cpu.yaml --port 8080
  jaxserve chat                       chat with a model in the terminal
  jaxserve export-tokenizer tok/      the served model's tokenizer as a HF directory
  jaxserve convert default ckpt/      save the model as placed in device memory (orbax);
  jaxserve serve ckpt/                then serve it: restarts in seconds
"""


# -- flags from the config tree ----------------------------------------------------------------
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
                     skip: Sequence[str] = ()) -> None:
    """One flag per leaf field of `config`, grouped by section. Defaults are SUPPRESSed so
    that only flags given on the command line appear in the parsed namespace."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, name, field in iter_leaf_fields(config):
        if name in skip:
            continue
        title = _SECTION_TITLES.get(type(section).__name__, type(section).__name__)
        group = groups.get(title) or groups.setdefault(
            title, parser.add_argument_group(f"{title} options"))
        flag = "--" + name.replace("_", "-")
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


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def config_from_args(config: Any, args: argparse.Namespace) -> Any:
    """Defaults ← `--config` YAML ← flags given on the command line."""
    if getattr(args, "config", None):
        values = load_yaml(args.config)
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


# -- the parser -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"jaxserve {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_serve_command(commands)
    _add_chat_command(commands)
    _add_export_tokenizer_command(commands)
    _add_compile_command(commands)
    _add_convert_command(commands)
    return parser


def _add_serve_command(commands: Any) -> None:
    """`jaxserve serve`: the OpenAI-compatible server; every ServeConfig flag."""
    serve = commands.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server",
        usage="jaxserve serve [MODEL] [--config FILE.yaml] [options]",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics ...).")
    _add_common(serve)
    add_config_flags(serve, ServeConfig())
    serve.add_argument("--print-config", action="store_true",
                       help="print the resolved configuration as YAML and exit")


def _add_chat_command(commands: Any) -> None:
    """`jaxserve chat`: a terminal chat on the same engine; every EngineConfig flag."""
    chat = commands.add_parser(
        "chat", help="chat with a model in the terminal",
        usage="jaxserve chat [MODEL] [--config FILE.yaml] [--system TEXT] [options]",
        description="An interactive chat in the terminal, on the same engine as `serve`. "
        "Type /reset to start over, /exit (or Ctrl-D) to leave.")
    _add_common(chat)
    add_config_flags(chat, EngineConfig())
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("--max-tokens", type=int, default=512, help="tokens per reply")
    chat.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature (default: the model's)")


def _add_export_tokenizer_command(commands: Any) -> None:
    """`jaxserve export-tokenizer`: the served tokenizer as a Hugging Face directory."""
    export = commands.add_parser(
        "export-tokenizer", help="write a model's tokenizer as a Hugging Face directory",
        usage="jaxserve export-tokenizer OUT_DIR [--model MODEL] [--tokenizer DIR]",
        description="Write the tokenizer `jaxserve serve` would use (a GGUF's included) as a "
        "Hugging Face tokenizer directory, for clients that tokenize themselves "
        "(lm-eval's tokenizer=OUT_DIR).")
    export.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created)")
    export.add_argument("--model", default=None,
                        help="model directory, .gguf file or cached HF name (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    export.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or name, if not the model's")
    export.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a path to one, to store instead of "
                        "the model's")
    export.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])


def _add_compile_command(commands: Any) -> None:
    """`jaxserve compile`: deviceless ahead-of-time compilation and a memory plan."""
    compile_ = commands.add_parser(
        "compile", help="compile the engine's steps for a GPU (no GPU needed) and plan memory",
        usage="jaxserve compile [MODEL] --target {h100,h200,a100,cpu} --output DIR [--json] "
        "[options]",
        description="Build the engine's step for --target without a device and without "
        "reading weights (a directory holding only config.json is enough), compile every "
        "bucket the engine would use, plan the KV cache from the compiled programs (device "
        "memory x --gpu-memory-utilization - weights - the largest activation peak, or "
        "less where XLA's limit for a step, 80% of the device, leaves less), and "
        "write the serialized executables and a manifest to DIR for `jaxserve serve "
        "--aot-dir DIR`. GPU targets need `pip install 'jaxserve[gpu-compile]'`; 'cpu' "
        "compiles for this machine.")
    _add_common(compile_)
    add_config_flags(compile_, EngineConfig())
    compile_.add_argument("--target", required=True, help="h100, h200, a100 (files in "
                          "jaxserve/targets/), or cpu")
    compile_.add_argument("--output", required=True, metavar="DIR",
                          help="directory for the executables and manifest.json")
    compile_.add_argument("--plan-only", action="store_true",
                          help="compile only the smallest and largest buckets (what the plan "
                          "is made from), print the plan, write no executables")
    compile_.add_argument("--json", action="store_true",
                          help="print the plan as one JSON object, the last stdout line")


def _add_convert_command(commands: Any) -> None:
    """`jaxserve convert`: a model saved as orbax arrays, for fast restarts."""
    convert = commands.add_parser(
        "convert", help="save a model as it sits in device memory (orbax), for fast restarts",
        usage="jaxserve convert MODEL OUT [--quantization int8] [--tensor-parallel-size N]",
        description="Load MODEL as `serve` would (final dtype, quantized, sharded over "
        "--tensor-parallel-size devices) and write the arrays with orbax-checkpoint, plus "
        "the config and tokenizer, to OUT. `jaxserve serve OUT` / LLM(OUT) then restore each "
        "array straight onto its device. MODEL 'default' is the embedded SmolLM2.")
    convert.add_argument("model", metavar="MODEL",
                         help="model directory, .gguf file, cached HF name, or 'default'")
    convert.add_argument("out", metavar="OUT", help="directory to write (must be new or empty)")
    convert.add_argument("--quantization", default=None,
                         choices=["none", "int8", "gguf", "awq", "gptq"])
    convert.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    convert.add_argument("--dtype", default="model",
                         choices=["model", "auto", "float32", "bfloat16", "float16"],
                         help="the weights' dtype in the checkpoint: model (default; 'auto' is "
                         "the same) keeps the model's own (config.json's torch_dtype; float32 "
                         "for a GGUF), so the checkpoint is the same whatever machine converts "
                         "it; serving it with --dtype auto decides on the serving machine")
    convert.add_argument("--tokenizer", default=None,
                         help="tokenizer directory or name, if not the model's")
    convert.add_argument("--log-level", default="info",
                         choices=["debug", "info", "warning", "error"])


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                        help="model directory, .gguf file or cached HF name (default: the "
                        "embedded SmolLM2-135M-Instruct); same as --model")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="YAML file whose keys are these long flag names; flags given "
                        "on the command line override it")
    parser.add_argument("--log-level", default=os.environ.get("JAXSERVE_LOG_LEVEL", "info"),
                        choices=["debug", "info", "warning", "error"],
                        help="jaxserve's log level (default: info)")


def parse_serve_args(argv: Sequence[str]) -> ServeConfig:
    """`jaxserve serve ...` arguments (without the 'serve') → a ServeConfig."""
    args = build_parser().parse_args(["serve", *argv])
    return _serve_config(args)


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    config = config_from_args(ServeConfig(), args)
    if args.model_positional is not None:
        config.engine.model_config.model = args.model_positional
    return config


def _version() -> str:
    from jaxserve import __version__
    return __version__


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


# -- commands -------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    config = _serve_config(args)
    if args.print_config:
        sys.stdout.write(config_to_yaml(config))
        return 0
    setup_logging(args.log_level)
    from jaxserve.entrypoints.openai.api_server import run_server

    return run_server(config)


def cmd_chat(args: argparse.Namespace) -> int:
    config = config_from_args(EngineConfig(), args)
    if args.model_positional is not None:
        config.model_config.model = args.model_positional
    setup_logging(args.log_level if args.log_level != "info" else "warning")
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.entrypoints.chat import run_chat

    print("loading the model ...", file=sys.stderr, flush=True)
    engine = LLMEngine(config, log_stats=False)
    return run_chat(engine, system=args.system, max_tokens=args.max_tokens,
                    temperature=args.temperature)


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from jaxserve.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or args.model, chat_template=args.chat_template)
    os.makedirs(args.out_dir, exist_ok=True)
    tokenizer.save_pretrained(args.out_dir)
    print(f"wrote the tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens) to "
          f"{args.out_dir}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from jaxserve.entrypoints.convert import convert_model

    model = None if args.model == "default" else args.model
    path = convert_model(model, args.out, quantization=args.quantization,
                         tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
                         tokenizer=args.tokenizer)
    print(f"wrote {path}; serve it with `jaxserve serve {path}`")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    config = config_from_args(EngineConfig(), args)
    if args.model_positional is not None:
        config.model_config.model = args.model_positional
    setup_logging(args.log_level)
    from jaxserve.entrypoints.compile import run_compile

    return run_compile(config, args.target, args.output, as_json=args.json,
                       plan_only=args.plan_only)


_COMMANDS = {"serve": cmd_serve, "chat": cmd_chat, "export-tokenizer": cmd_export_tokenizer,
             "convert": cmd_convert, "compile": cmd_compile}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        # Bad options, files or values: one readable line (the traceback with --log-level debug).
        # Anything else is a bug and keeps its traceback.
        if args.log_level == "debug":
            raise
        print(f"jaxserve {args.command}: error: {exc} (--log-level debug shows the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
