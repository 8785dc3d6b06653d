"""Every `vllm serve` flag is implemented, accepted with a warning, or refused with one line
(jaxserve/entrypoints/vllm_compat.py over the committed vllm_flags.json)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxserve.entrypoints.cli import main, parse_serve_args, serve_option_strings
from jaxserve.entrypoints.vllm_compat import (
    ACCEPTED,
    REFUSED,
    FlagError,
    table,
    translate_serve_argv,
    vllm_flags,
)

pytestmark = pytest.mark.fast
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_vllm_serve_flag_is_implemented_accepted_or_refused():
    version, flags = vllm_flags()
    assert version.startswith("0.32") and len(flags) > 300
    rows = table(serve_option_strings())
    unclassified = [flag.flag for flag, status, _ in rows
                    if status not in ("implemented", "accepted", "refused")]
    assert unclassified == [], f"vLLM {version} flags in no class: {unclassified}"
    # A flag sits in one class only, and the tables name only flags vLLM has.
    accepted = [f for flags_ in ACCEPTED.values() for f in flags_]
    assert len(accepted) == len(set(accepted))
    assert not set(accepted) & set(REFUSED)
    known = {name for flag in flags for name in (flag.flag, *flag.aliases)}
    assert set(accepted) <= known and set(REFUSED) <= known
    ours = serve_option_strings()
    assert not (set(accepted) | set(REFUSED)) & ours, "a jaxserve flag is also listed as not ours"


def test_quickstart_compose_command_line_parses_unchanged():
    config = parse_serve_args([
        "--model", "m", "--tensor-parallel-size", "3", "--max-model-len", "4096",
        "--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--max-num-seqs", "256",
        "--disable-log-requests", "--max-num-active-seqs", "64", "--enforce-eager",
        "--trust-remote-code", "--pipeline-parallel-size", "1",
        "--disable-custom-all-reduce", "--compilation-config", '{"level": 3}',
        "--limit-mm-per-prompt", '{"image": 0}', "--max_num_batched_tokens", "1024",
        "-tp", "3", "--device-memory-utilization=0.8", "--api-key", "a", "b",
        "--served-model-name", "smol", "--enable-log-requests", "--root-path", "/llm",
        "--override-generation-config", '{"temperature": 0.5}'])
    engine, server = config.engine, config.server
    assert engine.parallel_config.tensor_parallel_size == 3
    assert engine.cache_config.gpu_memory_utilization == 0.8
    assert engine.scheduler_config.max_num_active_seqs == 64
    assert engine.scheduler_config.max_num_batched_tokens == 1024
    assert engine.runner_config.enforce_eager and engine.model_config.trust_remote_code
    assert engine.model_config.override_generation_config == {"temperature": 0.5}
    assert server.api_key == ["a", "b"] and server.root_path == "/llm"
    assert server.enable_log_requests and server.disable_log_requests


def test_accepted_flags_are_dropped_with_one_warning_each_and_their_values():
    ours = serve_option_strings()
    out = translate_serve_argv(
        ["--disable-custom-all-reduce", "--cudagraph-capture-sizes", "1", "2", "4",
         "--max-num-seqs", "8", "--mm-processor-kwargs", '{"a": 1}', "--api-server-count",
         "1"], ours)
    assert out.argv == ["--max-num-seqs", "8"]
    assert len(out.warnings) == 4
    assert "--disable-custom-all-reduce" in out.warnings[0] and "XLA" in out.warnings[0]


@pytest.mark.parametrize("argv, words", [
    (["--prefill-context-parallel-size", "2"], ["--prefill-context-parallel-size",
                                                "not implemented", "--tensor-parallel-size"]),
    (["--cpu-offload-gb", "4"], ["--cpu-offload-gb", "not implemented"]),
    (["--frobnicate"], ["unknown flag --frobnicate", "--help"]),
    (["--max-num-queued-reqs", "9"], ["--max-queued-requests"]),
])
def test_refused_and_unknown_flags_are_one_line_and_exit_status_2(argv, words, capsys):
    with pytest.raises(FlagError):
        translate_serve_argv(argv, serve_option_strings())
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "usage" not in err.lower(), err
    for word in words:
        assert word in err


def test_a_bad_value_is_one_line_without_the_usage_dump(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--dtype", "float64"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "usage" not in err.lower() and "--dtype" in err


def test_help_groups_flags_as_vllm_and_help_vllm_prints_the_table():
    run = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve"]
    env = {**os.environ, "PYTHONPATH": REPO}
    helptext = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env,
                              check=True).stdout
    for section in ("ModelConfig:", "CacheConfig:", "SchedulerConfig:", "Frontend:",
                    "ParallelConfig:"):
        assert section in helptext
    table_text = subprocess.run([*run, "--help=vllm"], capture_output=True, text=True,
                                env=env, check=True).stdout
    assert "316 in all" in table_text and "UNCLASSIFIED" not in table_text
    assert "--disable-custom-all-reduce" in table_text


def test_a_bad_keys_file_or_backend_stops_the_start_before_the_model_loads(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: a\n    rpm: 3\n")
    assert main(["serve", "--api-keys-file", str(keys), "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown field" in err and "rpm" in err
    assert main(["serve", "--rate-limit-backend", "mongodb://x", "--model", "/no"]) == 2
    assert "--rate-limit-backend" in capsys.readouterr().err
    assert main(["serve", "--ssl-certfile", str(keys), "--model", "/no"]) == 2
    assert "go together" in capsys.readouterr().err


def test_readme_carries_the_current_table():
    from jaxserve.entrypoints.vllm_compat import summary

    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert summary(serve_option_strings(), markdown=True) in readme, \
        "regenerate README's table: python -m jaxserve.entrypoints.vllm_compat --markdown"


def test_a_vllm_config_yaml_is_settled_like_its_command_line(tmp_path, capsys):
    import yaml

    path = tmp_path / "vllm.yaml"
    path.write_text("max-num-seqs: 4\ndevice-memory-utilization: 0.5\n"
                    "disable-custom-all-reduce: true\npipeline-parallel-size: 1\n"
                    "max_model_len: 256\n")
    assert main(["serve", "--config", str(path), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["max-num-seqs"] == 4 and printed["gpu-memory-utilization"] == 0.5
    assert printed["max-model-len"] == 256
    path.write_text("prefill-context-parallel-size: 2\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "prefill-context-parallel-size" in err and "not implemented" in err
    path.write_text("frobnicate: 2\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "frobnicate" in capsys.readouterr().err
