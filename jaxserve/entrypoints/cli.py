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
  jaxserve serve Qwen/Qwen3-0.6B      serve a model from the Hugging Face Hub (downloaded once)
  jaxserve download Qwen/Qwen3-0.6B   fetch and verify it only (image builds, init containers)
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


# -- the parser -----------------------------------------------------------------------------------
class _OneLineErrorParser(argparse.ArgumentParser):
    """A bad command line is one line on stderr and exit status 2 (no usage dump)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the "
                  "flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="jaxserve", description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"jaxserve {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=_OneLineErrorParser)

    _add_serve_command(commands)
    _add_chat_command(commands)
    _add_export_tokenizer_command(commands)
    _add_compile_command(commands)
    _add_convert_command(commands)
    _add_download_command(commands)
    return parser


def _add_serve_command(commands: Any) -> None:
    """`jaxserve serve`: the OpenAI-compatible server; every ServeConfig flag."""
    serve = commands.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server",
        usage="jaxserve serve [MODEL] [--config FILE.yaml] [options]",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics ...).")
    _add_common(serve)
    add_config_flags(serve, ServeConfig(), vllm_groups=True)
    serve.add_argument("--print-config", action="store_true",
                       help="print the resolved configuration as YAML and exit")
    serve.epilog = ("vLLM command lines run unchanged: each `vllm serve` flag is implemented, "
                    "accepted with a warning, or refused with what to use instead; "
                    "`jaxserve serve --help=vllm` prints the table.")


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
                        help="model directory, .gguf file or Hub name org/name (default: the "
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
                         help="model directory, .gguf file, Hub name org/name, or 'default'")
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
    _add_hub_flags(convert)
    convert.add_argument("--log-level", default="info",
                         choices=["debug", "info", "warning", "error"])


def _add_hub_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for a model named by its Hub id (the ModelConfig fields of that name)."""
    parser.add_argument("--revision", default=None,
                        help="the model's Hub revision: branch, tag or commit (default: main)")
    parser.add_argument("--download-dir", default=None, help="the Hugging Face cache to use "
                        "(default: HF_HUB_CACHE, else HF_HOME/hub)")
    parser.add_argument("--hf-token", default=None,
                        help="token for gated or private models (default: HF_TOKEN)")


def _add_download_command(commands: Any) -> None:
    """`jaxserve download`: fetch and verify what `serve` would, print where it is."""
    download = commands.add_parser(
        "download", help="download and verify a model from the Hugging Face Hub",
        usage="jaxserve download MODEL [--revision R] [--download-dir DIR] [--hf-token T]",
        description="Fetch exactly the files `jaxserve serve MODEL` would (safetensors, "
        "config, tokenizer, chat template; one .gguf of a GGUF repo), check each against the "
        "Hub's sha256, and print the snapshot directory (or .gguf file). Then `jaxserve "
        "serve MODEL` starts with HF_HUB_OFFLINE=1: for image builds and init containers.")
    download.add_argument("model", metavar="MODEL", help="org/name, or org/name:QUANT")
    _add_hub_flags(download)
    download.add_argument("--gguf-file", default=None,
                          help="for a GGUF repo: the file (or quant tag) to fetch")
    download.add_argument("--tokenizer", default=None,
                          help="another repo's tokenizer to fetch too (as serve's --tokenizer)")
    download.add_argument("--tokenizer-revision", default=None)
    download.add_argument("--log-level", default="info",
                          choices=["debug", "info", "warning", "error"])


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                        help="model directory, .gguf file or Hub name org/name (default: the "
                        "embedded SmolLM2-135M-Instruct); same as --model")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="YAML file whose keys are these long flag names; flags given "
                        "on the command line override it")
    parser.add_argument("--log-level", default=os.environ.get("JAXSERVE_LOG_LEVEL", "info"),
                        choices=["debug", "info", "warning", "error"],
                        help="jaxserve's log level (default: info)")


def parse_serve_args(argv: Sequence[str]) -> ServeConfig:
    """`jaxserve serve ...` arguments (without the 'serve') → a ServeConfig. vLLM's flags
    are settled first (vllm_compat.py); a refused or unknown one raises FlagError."""
    from jaxserve.entrypoints.vllm_compat import translate_serve_argv

    translated = translate_serve_argv(argv, serve_option_strings())
    args = build_parser().parse_args(["serve", *translated.argv])
    return _serve_config(args)


def serve_option_strings() -> frozenset[str]:
    """Every option string `jaxserve serve` takes (--no-X forms included)."""
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return frozenset(o for action in serve._actions for o in action.option_strings)


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    config = config_from_args(ServeConfig(), args, vllm_keys=True)
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
    # The Hub client logs every HTTP request at INFO; the download's own lines say enough.
    if level != "debug":
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)


# -- commands -------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    config = _serve_config(args)
    if args.print_config:
        sys.stdout.write(config_to_yaml(config))
        return 0
    setup_logging(args.log_level)
    check_server_options(config)
    for warning in getattr(args, "vllm_warnings", ()):
        logger.warning("%s", warning)
    if config.engine.model_config.trust_remote_code:
        logger.info("--trust-remote-code: jaxserve runs its own implementation of the model's "
                    "architecture; no code from the model repository runs")
    if config.server.disable_log_requests:
        logger.warning("--disable-log-requests is deprecated (removed in vLLM 0.32): requests "
                       "are not logged unless --enable-log-requests")
    from jaxserve.entrypoints.openai.api_server import run_server

    return run_server(config)


def check_server_options(config: ServeConfig) -> None:
    """The HTTP front end's files and backends, checked before the model loads (minutes),
    so a typo in them is one error line at once: the keys file, TLS files, rate limiter,
    trace exporter."""
    from jaxserve.entrypoints.openai.api_server import uvicorn_options
    from jaxserve.entrypoints.openai.middleware import key_table_from
    from jaxserve.entrypoints.openai.rate_limit import backend_kind

    key_table_from(config)
    uvicorn_options(config.server)
    backend_kind(config.server.rate_limit_backend)
    if config.server.otlp_traces_endpoint:
        from jaxserve.entrypoints.openai.tracing import check_available
        check_available()


def cmd_chat(args: argparse.Namespace) -> int:
    config = config_from_args(EngineConfig(), args)
    if args.model_positional is not None:
        config.model_config.model = args.model_positional
    setup_logging(args.log_level if args.log_level != "info" else "warning")
    from jaxserve.engine.core import EngineCore
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.entrypoints.chat import run_chat

    print("loading the model ...", file=sys.stderr, flush=True)
    engine = LLMEngine(EngineCore(config, log_stats=False))
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
                         tokenizer=args.tokenizer, revision=args.revision,
                         download_dir=args.download_dir, hf_token=args.hf_token)
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


def cmd_download(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from jaxserve.loader.hub_download import HubOptions, fetch_from_hub
    from jaxserve.loader.resolve import is_repo_id

    if not is_repo_id(args.model):
        raise ValueError(f"{args.model!r} is not a Hugging Face repo id (org/name)")
    path = fetch_from_hub(args.model, "model", HubOptions(
        args.revision, args.download_dir, args.hf_token, args.gguf_file))
    if args.tokenizer is not None:
        fetch_from_hub(args.tokenizer, "tokenizer", HubOptions(
            args.tokenizer_revision, args.download_dir, args.hf_token))
    print(path)
    return 0


_COMMANDS = {"serve": cmd_serve, "chat": cmd_chat, "export-tokenizer": cmd_export_tokenizer,
             "convert": cmd_convert, "compile": cmd_compile, "download": cmd_download}


def _long_flag_names(argv: Sequence[str]) -> list[str]:
    """vLLM's short engine flags (-tp 8, -pp=2, -q int8) as their long names."""
    from jaxserve.entrypoints.vllm_compat import RENAMED

    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        short = name.startswith("-") and not name.startswith("--")
        out.append(RENAMED[name] + eq + value if short and name in RENAMED else arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_warnings: list[str] = []
    if argv[:1] == ["serve"]:
        from jaxserve.entrypoints.vllm_compat import FlagError, summary, translate_serve_argv

        if "--help=vllm" in argv:
            print(summary(serve_option_strings()))
            return 0
        try:
            translated = translate_serve_argv(argv[1:], serve_option_strings())
        except FlagError as exc:
            print(f"jaxserve serve: error: {exc}", file=sys.stderr)
            return 2
        argv, vllm_warnings = ["serve", *translated.argv], translated.warnings
    elif argv[:1] == ["compile"]:      # the engine flags' short vLLM spellings (-tp, -pp)
        argv = ["compile", *_long_flag_names(argv[1:])]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.vllm_warnings = vllm_warnings
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
