"""`jaxserve serve [MODEL]`, `jaxserve chat [MODEL]`, `jaxserve convert MODEL OUT` and
`jaxserve export-tokenizer OUT_DIR`, `jaxserve compile`, `jaxserve download`: the parser
and each command's entry. The engine flags come from the config tree
(entrypoints/config_flags.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from jaxserve.config import EngineConfig, ServeConfig
from jaxserve.entrypoints.config_flags import add_config_flags, config_from_args, config_to_yaml

logger = logging.getLogger("jaxserve.cli")

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
