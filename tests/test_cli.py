"""`jaxserve` command line: flags from the config tree, YAML configs, the terminal chat."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxserve.config import ServeConfig, iter_leaf_fields
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.chat import run_chat
from jaxserve.entrypoints.cli import build_parser, config_to_yaml, main, parse_serve_args
from jaxserve.entrypoints.openai.api_server import api_key_from

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
except ImportError:
    from fake_engine import FakeEngineCore

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))

ISSUE_FLAGS = ["--host", "--port", "--api-key", "--served-model-name", "--max-model-len",
               "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
               "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--dtype", "--seed",
               "--enable-prefix-caching", "--no-enable-prefix-caching",
               "--tensor-parallel-size", "--chat-template", "--generation-config",
               "--uvicorn-log-level", "--config"]


def test_serve_help_lists_every_vllm_flag_and_every_config_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ISSUE_FLAGS:
        assert flag in text, flag
    for _, name, _ in iter_leaf_fields(ServeConfig()):
        assert "--" + name.replace("_", "-") in text, name


def test_console_script_help_runs():
    result = subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli", "--help"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0
    assert "serve" in result.stdout and "chat" in result.stdout


def test_flags_map_onto_the_config_tree():
    config = parse_serve_args(["/models/x", "--max-model-len", "512", "--port", "9001",
                               "--served-model-name", "a", "b", "--no-enable-prefix-caching",
                               "--gpu-memory-utilization", "0.5", "--api-key", "k"])
    engine = config.engine
    assert engine.model_config.model == "/models/x"
    assert engine.model_config.max_model_len == 512
    assert engine.model_config.served_model_name == ["a", "b"]
    assert engine.cache_config.enable_prefix_caching is False
    assert engine.cache_config.gpu_memory_utilization == 0.5
    assert config.server.port == 9001 and config.server.api_key == ["k"]


def test_command_line_wins_over_the_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max-model-len: 256\nport: 8123\nmax-num-seqs: 4\n")
    config = parse_serve_args(["--config", str(path), "--max-model-len", "1024"])
    assert config.engine.model_config.max_model_len == 1024      # flag wins
    assert config.server.port == 8123                            # file over default
    assert config.engine.scheduler_config.max_num_seqs == 4
    assert config.engine.scheduler_config.max_num_batched_tokens is None   # default


def test_yaml_config_round_trips(tmp_path):
    config = parse_serve_args(["m", "--max-model-len", "300", "--served-model-name", "x",
                               "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "1000"])
    path = tmp_path / "round.yaml"
    path.write_text(config_to_yaml(config))
    again = parse_serve_args(["--config", str(path)])
    assert again.to_flat_dict() == config.to_flat_dict()
    assert again == config


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_config_loads_and_validates(path):
    keys = yaml.safe_load(path.read_text())
    config = parse_serve_args(["--config", str(path)])
    flat = config.to_flat_dict()
    for key, value in keys.items():
        assert flat[key.replace("-", "_")] == value, key
    from jaxserve.platforms import platform_named

    platform = platform_named("gpu" if "gpu" in path.name else "cpu")
    platform.resolve_config(config.engine)


def test_example_configs_exist():
    assert {p.name for p in CONFIGS} >= {"cpu.yaml", "gpu-8b.yaml", "tiny-test.yaml"}


def test_unknown_yaml_key_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("max-model-length: 5\n")
    assert main(["serve", "--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "max_model_length" in err and "bad.yaml" in err


@pytest.mark.parametrize("line, fragment", [("max-model-len: lots", "max-model-len must be int"),
                                            ("dtype: fp8", "dtype must be one of"),
                                            ("served-model-name: [1]", "list of str")])
def test_badly_typed_yaml_value_is_a_readable_error(tmp_path, capsys, line, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(line + "\n")
    assert main(["serve", "--config", str(path), "--print-config"]) == 2
    assert fragment in capsys.readouterr().err


def test_print_config_prints_yaml(capsys):
    assert main(["serve", "--max-num-seqs", "7", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["max-num-seqs"] == 7


def test_api_key_comes_from_flag_or_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    assert api_key_from(parse_serve_args([])) == ["from-env"]
    assert api_key_from(parse_serve_args(["--api-key", "flag"])) == ["flag"]
    assert api_key_from(parse_serve_args(["--api-key", "a", "b"])) == ["a", "b"]
    monkeypatch.delenv("JAXSERVE_API_KEY")
    assert api_key_from(parse_serve_args([])) is None


def test_chat_command_parses_engine_flags_only():
    args = build_parser().parse_args(["chat", "m", "--max-model-len", "128", "--system", "hi"])
    assert args.model_positional == "m" and args.max_model_len == 128 and args.system == "hi"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--port", "1"])


def test_terminal_chat_streams_replies_and_keeps_history():
    engine = LLMEngine(FakeEngineCore())
    lines = iter(["hello", "/reset", "again", "/exit"])
    out = io.StringIO()
    assert run_chat(engine, system="be brief", max_tokens=5, read=lambda _: next(lines),
                    out=out) == 0
    replies = [line for line in out.getvalue().splitlines() if line and "/" not in line
               and not line.startswith("(")]
    assert len(replies) == 2 and all(len(r) == 5 for r in replies)
    assert "(conversation cleared)" in out.getvalue()


def test_export_tokenizer_writes_a_directory_huggingface_loads(make_tiny_model, tmp_path,
                                                               capsys):
    import transformers

    from jaxserve.loader.tokenizer import load_tokenizer

    model_dir = make_tiny_model("llama")
    assert main(["export-tokenizer", str(tmp_path / "tok"), "--model", str(model_dir)]) == 0
    assert "wrote the tokenizer" in capsys.readouterr().out
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    served = load_tokenizer(str(model_dir))
    text = "The quick brown fox, café 12345!"
    assert exported.encode(text) == served.encode(text)
    assert exported.chat_template == served.chat_template
    assert exported.eos_token == served.eos_token
