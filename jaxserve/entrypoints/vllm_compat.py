"""Every `vllm serve` flag, accounted for: implemented, accepted with a warning, or refused.

vllm_flags.json (written by tools/vllm_flags.py from vLLM's own parser) lists the flags of
one vLLM version. Each is, here:

- implemented: `jaxserve serve` has a flag of that name (or alias) and meaning;
- accepted: it means nothing on a JAX engine (a CUDA-graph size, an NCCL switch, a
  multimodal cache...): one warning line with the reason, then it is dropped;
- refused: it asks for something jaxserve does not do; one error line naming the flag and
  what to use instead, exit status 2.

`translate_serve_argv` applies this to a command line before argparse sees it; a flag that
is neither jaxserve's nor vLLM's is one clear error line too. `python -m
jaxserve.entrypoints.vllm_compat` prints the table (--markdown: the README's summary).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

FLAGS_FILE = os.path.join(os.path.dirname(__file__), "vllm_flags.json")

# Flags another branch adds (Hub downloads); implemented by name: once they are jaxserve's
# flags the translation keeps them, until then they are refused with this note.
PENDING = {
    "--revision": "Hub downloads", "--tokenizer-revision": "Hub downloads",
    "--download-dir": "Hub downloads", "--hf-token": "Hub downloads",
}

# vLLM flags whose jaxserve name differs, or a vLLM alias jaxserve lacks: vLLM name -> ours.
RENAMED = {
    "--device-memory-utilization": "--gpu-memory-utilization",
    "-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size", "-q": "--quantization",
    "-sc": "--speculative-config", "-ep": "--enable-expert-parallel",
    "-pp": "--pipeline-parallel-size",
}

_CUDA = "a CUDA/PyTorch mechanism; XLA compiles the whole step ahead of time"
_MM = "jaxserve serves text-only models: nothing multimodal to configure"
_MAMBA = "no Mamba/SSM architectures here"
_NCCL = "XLA inserts the collectives of a sharded step (no NCCL or custom all-reduce)"
_DEFAULT = "a knob of vLLM's own implementation with no counterpart here; jaxserve " \
    "behaves as vLLM does by default"
_LOG = "jaxserve's logs and metrics are configured by --log-level, --disable-log-stats and " \
    "/metrics"

ACCEPTED: dict[str, tuple[str, ...]] = {
    _CUDA: ("--compilation-config", "--cudagraph-capture-sizes", "--max-cudagraph-capture-size",
            "--optimization-level", "--performance-mode", "--enable-cumem-allocator",
            "--kernel-config", "--linear-backend", "--moe-backend", "--ir-op-priority",
            "--sparse-indexer-topk-backend", "--enable-flashinfer-autotune",
            "--gdn-prefill-backend", "--kda-decode-backend", "--kda-prefill-backend",
            "--attention-config", "--use-fp64-gumbel", "--enable-nccl-comm-suspend",
            "--sleep-mode-offload-cudagraph", "--pt-load-map-location", "--ubatch-size",
            "--enable-dbo", "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold",
            "--enable-batch-sharded-sampling", "--enable-shm-tensor-arena", "--worker-cls",
            "--worker-extension-cls", "--distributed-executor-backend", "--device-ids",
            "--max-parallel-loading-workers", "--safetensors-load-strategy",
            "--safetensors-prefetch-block-size", "--safetensors-prefetch-num-threads",
            "--use-tqdm-on-load", "--disable-cascade-attn", "--renderer-num-workers",
            "--enable-hc-sp", "--numa-bind", "--numa-bind-cpus", "--numa-bind-nodes"),
    _NCCL: ("--disable-custom-all-reduce", "--disable-nccl-for-dp-synchronization",
            "--all2all-backend", "--distributed-timeout-seconds",
            "--cpu-distributed-timeout-seconds", "--data-parallel-backend",
            "--dp-sync-interval", "--ray-workers-use-nsight", "--dcp-comm-backend"),
    _MM: ("--allowed-local-media-path", "--allowed-media-domains", "--enable-mm-embeds",
          "--interleave-mm-strings", "--language-model-only", "--limit-mm-per-prompt",
          "--media-io-kwargs", "--mm-device-do-normalize", "--mm-encoder-attn-backend",
          "--mm-encoder-attn-dtype", "--mm-encoder-fp8-scale-path",
          "--mm-encoder-fp8-scale-save-margin", "--mm-encoder-fp8-scale-save-path",
          "--mm-encoder-tp-mode", "--mm-hasher-algorithm", "--mm-ipc-gpu-memory-gb",
          "--mm-processor-cache-gb", "--mm-processor-cache-type", "--mm-processor-device",
          "--mm-processor-kwargs", "--mm-shm-cache-max-object-size-mb", "--mm-tensor-ipc",
          "--skip-mm-profiling", "--video-pruning-method", "--video-pruning-rate",
          "--disable-chunked-mm-input", "--trust-request-mm-kwargs", "--default-mm-loras",
          "--enable-tower-connector-lora", "--ec-manager-config"),
    _MAMBA: ("--enable-mamba-cache-stochastic-rounding", "--enable-mamba-shared-prefix-checkpoint",
             "--mamba-backend", "--mamba-block-size", "--mamba-cache-dtype", "--mamba-cache-mode",
             "--mamba-cache-philox-rounds", "--mamba-ssm-cache-dtype", "--mamba-ssu-algorithm",
             "--use-replayssm", "--replayssm-buffer-len", "--swa-bounded-replay"),
    _DEFAULT: ("--prefix-caching-hash-algo", "--disable-hybrid-kv-cache-manager",
               "--enable-force-include-usage", "--exclude-tools-when-tool-choice-none",
               "--disable-fastapi-docs", "--enable-offline-docs", "--h11-max-header-count",
               "--h11-max-incomplete-event-size", "--sse-keep-alive-interval",
               "--enable-request-id-headers", "--chat-template-content-format",
               "--response-role", "--max-log-len", "--tool-strict-level",
               "--scheduler-reserve-full-isl", "--long-prefill-token-threshold-adaptive",
               "--prefill-schedule-interval", "--stream-interval", "--watermark",
               "--prefix-cache-retention-interval", "--prefix-match-unit",
               "--kv-sharing-fast-prefill", "--fail-on-environ-validation",
               "--enable-server-load-tracking", "--config-format", "--code-revision",
               "--allow-deprecated-quantization", "--enable-ep-weight-filter",
               "--expert-placement-strategy", "--fully-sharded-loras", "--lora-dtype",
               "--specialize-active-lora", "--max-lora-cls-labels", "--enable-moe-shared-loras",
               "--enable-mixed-moe-lora-format", "--cp-kv-cache-interleave-size",
               "--dcp-kv-cache-interleave-size", "--dcp-q-replicate",
               "--anthropic-disabled-thinking-effort", "--cohere-format",
               "--cohere-is-reasoning-model", "--enable-flash-late-interaction",
               "--fingerprint-mode", "--fingerprint-value"),
    _LOG: ("--aggregate-engine-logging", "--enable-log-deltas", "--enable-log-outputs",
           "--enable-logging-iteration-details", "--enable-mfu-metrics",
           "--enable-per-request-metrics", "--cudagraph-metrics", "--kv-cache-metrics",
           "--kv-cache-metrics-sample", "--custom-histogram-buckets", "--jit-monitor-mode",
           "--jit-monitor-verbose", "--enable-layerwise-nvtx-tracing",
           "--per-request-spec-decode-metrics", "--show-hidden-metrics-for-version",
           "--disable-access-log-for-endpoints", "--log-error-stack", "--log-config-file",
           "--logging-config", "--profiler-config", "--collect-detailed-traces"),
}

REFUSED: dict[str, str] = {
    # What the flag asks for -> what to use instead.
    "--prefill-context-parallel-size": "context parallelism is not implemented; use "
                                       "--tensor-parallel-size",
    "--decode-context-parallel-size": "context parallelism is not implemented; use "
                                      "--tensor-parallel-size",
    "--nnodes": "multi-host runs use --num-processes, --process-id and --coordinator-address",
    "--node-rank": "multi-host runs use --num-processes, --process-id and --coordinator-address",
    "--master-addr": "multi-host runs use --coordinator-address HOST:PORT",
    "--master-port": "multi-host runs use --coordinator-address HOST:PORT",
    "--headless": "every jaxserve process serves HTTP; multi-host followers are started "
                  "with --process-id",
    "--data-parallel-address": "data parallel replicas run in one process "
                               "(--data-parallel-size); across hosts run replicas behind a "
                               "Service",
    "--data-parallel-rank": "data parallel replicas run in one process (--data-parallel-size)",
    "--data-parallel-rpc-port": "data parallel replicas run in one process "
                                "(--data-parallel-size)",
    "--data-parallel-size-local": "data parallel replicas run in one process "
                                  "(--data-parallel-size)",
    "--data-parallel-start-rank": "data parallel replicas run in one process "
                                  "(--data-parallel-size)",
    "--data-parallel-external-lb": "run one jaxserve per replica behind your load balancer",
    "--data-parallel-hybrid-lb": "run one jaxserve per replica behind your load balancer",
    "--data-parallel-multi-port-external-lb": "run one jaxserve per replica behind your load "
                                              "balancer",
    "--data-parallel-supervisor-port": "run one jaxserve per replica behind your load balancer",
    "--dp-supervisor-probe-failure-threshold": "run one jaxserve per replica; probe /health",
    "--dp-supervisor-probe-interval-s": "run one jaxserve per replica; probe /health",
    "--dp-supervisor-probe-timeout-s": "run one jaxserve per replica; probe /health",
    "--api-server-count": "one API server process per replica; run more replicas",
    "--enable-scale-out": "run more replicas behind a Service",
    "--enable-eplb": "expert load balancing is not implemented; --enable-expert-parallel "
                     "shards experts evenly",
    "--eplb-config": "expert load balancing is not implemented",
    "--enable-elastic-ep": "elastic expert parallelism is not implemented",
    "--elastic-ep-max-dp-size": "elastic expert parallelism is not implemented",
    "--enable-fault-tolerance": "in-process recovery is always on (--max-engine-restarts)",
    "--fault-tolerance-config": "in-process recovery is always on (--max-engine-restarts)",
    "--grpc": "jaxserve serves the OpenAI HTTP API only",
    "--grpc-port": "jaxserve serves the OpenAI HTTP API only",
    "--uds": "serve on --host/--port (a Unix socket is not supported)",
    "--tokens-only": "jaxserve serves the full OpenAI API",
    "--middleware": "custom ASGI middleware is not loaded; put a proxy in front",
    "--tool-server": "built-in tool servers are not supported; use function tools",
    "--enable-ssl-refresh": "restart the server to pick up new certificates",
    "--ssl-ciphers": "the Python ssl defaults are used; terminate TLS at a proxy for custom "
                     "ciphers",
    "--enable-sleep-mode": "sleep mode is not implemented",
    "--sleep-preserve-parameter-names": "sleep mode is not implemented",
    "--enable-prompt-embeds": "prompts are text or token ids",
    "--mm-encoder-only": "jaxserve serves text-only models",
    "--disable-sliding-window": "a model's sliding window is always applied as its config "
                                "says; lower --max-model-len instead",
    "--default-chat-template-kwargs": "send chat_template_kwargs with each chat request",
    "--enable-return-routed-experts": "not implemented",
    "--enable-trace-replay": "not implemented",
    "--return-sampling-mask": "not implemented",
    "--logprobs-mode": "logprobs are the final distribution's (vLLM's processed_logprobs)",
    "--logits-processors": "custom logits processors are not supported; use logit_bias or "
                           "structured outputs",
    "--io-processor-plugin": "plugins are not supported",
    "--model-impl": "jaxserve runs its own implementation of each architecture",
    "--model-class-overrides": "jaxserve runs its own implementation of each architecture",
    "--runner": "jaxserve serves generative models only",
    "--convert": "jaxserve serves generative models only",
    "--pooler-config": "jaxserve serves generative models only (no pooling/embeddings)",
    "--hf-overrides": "edit config.json, or pass --max-model-len/--dtype",
    "--hf-config-path": "put config.json beside the weights",
    "--tokenizer-mode": "the tokenizer is Hugging Face's (or the GGUF's)",
    "--quantization-config": "--quantization picks the format; AWQ/GPTQ read config.json",
    "--kv-cache-dtype-skip-layers": "--kv-cache-dtype applies to every layer",
    "--model-loader-extra-config": "use --load-format",
    "--ignore-patterns": "safetensors files only are read",
    "--cpu-offload-gb": "weight offloading is not implemented; use --quantization int8",
    "--cpu-offload-params": "weight offloading is not implemented",
    "--offload-backend": "weight offloading is not implemented",
    "--offload-group-size": "weight offloading is not implemented",
    "--offload-num-in-group": "weight offloading is not implemented",
    "--offload-params": "weight offloading is not implemented",
    "--offload-prefetch-step": "weight offloading is not implemented",
    "--kv-offloading-backend": "KV offloading is not implemented",
    "--kv-offloading-size": "KV offloading is not implemented",
    "--kv-transfer-config": "disaggregated prefill is not implemented",
    "--kv-events-config": "KV cache events are not published",
    "--ec-transfer-config": "not implemented",
    "--weight-transfer-config": "not implemented",
    "--aux-output-config": "not implemented",
    "--diffusion-config": "jaxserve serves autoregressive LLMs",
    "--engram-config": "not implemented",
    "--watermark-config": "not implemented",
    "--reasoning-config": "use --reasoning-parser",
    "--reasoning-parser-plugin": "use --reasoning-parser (deepseek_r1, qwen3)",
    "--structured-outputs-config": "use --structured-outputs-disable-any-whitespace; the "
                                   "backend is jaxserve's own",
    "--additional-config": "not implemented",
    "--spec-method": "use --speculative-config '{\"method\": ...}'",
    "--spec-model": "use --speculative-config '{\"method\": \"draft_model\", \"model\": ...}'",
    "--spec-tokens": "use --speculative-config '{\"num_speculative_tokens\": N}'",
    "--lora-target-modules": "adapters are applied to the modules their config names",
    "--max-num-queued-reqs": "use --max-queued-requests (it counts sequences: prompts x n)",
    "--max-num-queued-tokens": "use --max-queued-requests",
    "--max-num-scheduled-tokens": "use --max-num-batched-tokens",
    "--scheduling-policy": "scheduling is first-come first-served (vLLM's default fcfs)",
    "--scheduler-cls": "the scheduler is jaxserve's own",
}

# Refused flags given their no-op value are accepted instead (vLLM defaults).
HARMLESS_VALUES = {
    "--prefill-context-parallel-size": {"1"},
    "--decode-context-parallel-size": {"1"}, "--api-server-count": {"1"},
    "--nnodes": {"1"}, "--node-rank": {"0"}, "--scheduling-policy": {"fcfs"},
    "--model-impl": {"auto"}, "--runner": {"auto", "generate"}, "--convert": {"auto", "none"},
    "--tokenizer-mode": {"auto", "hf"}, "--logprobs-mode": {"processed_logprobs"},
    "--data-parallel-rank": {"0"}, "--data-parallel-start-rank": {"0"},
}


@dataclasses.dataclass(frozen=True)
class VllmFlag:
    flag: str
    aliases: tuple[str, ...]
    dest: str
    group: str
    takes_value: bool
    nargs: int | str | None
    help: str


@functools.cache
def vllm_flags() -> tuple[str, tuple[VllmFlag, ...]]:
    """(vLLM version, its serve flags) from the committed data."""
    with open(FLAGS_FILE) as f:
        data = json.load(f)
    flags = tuple(VllmFlag(d["flag"], tuple(d["aliases"]), d["dest"], d["group"],
                           d["takes_value"], d["nargs"], d["help"]) for d in data["flags"])
    return data["vllm_version"], flags


@functools.cache
def _accepted_reasons() -> dict[str, str]:
    return {flag: reason for reason, flags in ACCEPTED.items() for flag in flags}


def classify(flag: VllmFlag, ours: frozenset[str]) -> tuple[str, str]:
    """(status, note) of a vLLM flag given jaxserve serve's option strings: status is
    implemented, accepted or refused; note is the reason (accepted) or what to use instead
    (refused), the jaxserve flag it maps to (implemented under another name), or ''."""
    names = (flag.flag, *flag.aliases)
    if flag.flag in ours:
        return "implemented", ""
    for name in names:
        if RENAMED.get(name) in ours:
            return "implemented", RENAMED[name]
        if name in ours:
            return "implemented", name
    if flag.flag in PENDING:
        return "implemented", f"with the {PENDING[flag.flag]} work"
    if flag.flag in _accepted_reasons():
        return "accepted", _accepted_reasons()[flag.flag]
    if flag.flag in REFUSED:
        return "refused", REFUSED[flag.flag]
    return "unclassified", ""


# -- the command line ------------------------------------------------------------------------------
class FlagError(ValueError):
    """A flag jaxserve refuses, or knows nowhere: one line for the user."""


@dataclasses.dataclass
class Translation:
    """What is left for argparse (`argv`) or the config tree (`values`), and the warning
    lines for the accepted vLLM flags that were dropped."""
    argv: list[str]
    warnings: list[str]
    values: dict[str, Any] = dataclasses.field(default_factory=dict)


def translate_serve_argv(argv: Sequence[str], ours: Iterable[str]) -> Translation:
    """`jaxserve serve` arguments with vLLM's flags settled: jaxserve's own kept (vLLM's
    underscore spellings and renamed flags rewritten), accepted ones dropped with a warning,
    refused or unknown ones raised as FlagError."""
    ours = frozenset(ours)
    version, flags = vllm_flags()
    by_name = {name: flag for flag in flags for name in (flag.flag, *flag.aliases)}
    out: list[str] = []
    warnings: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg == "--" or _is_number(arg):
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")     # vLLM takes --max_model_len too
        if name in ours:
            out.append(name + eq + value)
            continue
        if RENAMED.get(name) in ours:
            out.append(RENAMED[name] + eq + value)
            continue
        flag = by_name.get(name)
        if flag is None:
            raise FlagError(f"unknown flag {name}: neither a jaxserve serve flag nor a vLLM "
                            f"{version} one (`jaxserve serve --help` lists them)")
        values = [value] if eq else []
        if not eq and flag.takes_value and not name.startswith("--no-"):
            i, values = _take_values(args, i, flag.nargs)
        status, note = classify(flag, ours)
        if status == "refused" and values and set(values) <= HARMLESS_VALUES.get(flag.flag,
                                                                                  set()):
            warnings.append(f"{name} {' '.join(values)}: accepted (vLLM's default; nothing "
                            "to do)")
            continue
        if status == "accepted":
            warnings.append(f"{name}: accepted and ignored ({note})")
            continue
        if status == "implemented":      # pending: another branch adds it
            raise FlagError(f"{name} is not available in this build yet ({note})")
        if status == "refused":
            raise FlagError(f"{name} is not supported: {note}")
        raise FlagError(f"{name} (vLLM {version}) is not classified by jaxserve yet")
    return Translation(out, warnings)


def translate_config_keys(values: dict[str, Any], leaves: Iterable[str], source: str
                          ) -> Translation:
    """A `--config` YAML's keys (underscore names) with vLLM's settled as on the command
    line: renamed ones renamed, accepted ones dropped with a warning, refused ones raised.
    Keys neither jaxserve's nor vLLM's are kept (in `values`), for the config's own
    unknown-key error."""
    leaves = frozenset(leaves)
    version, flags = vllm_flags()
    by_name = {name: flag for flag in flags for name in (flag.flag, *flag.aliases)}
    kept: dict[str, Any] = {}
    warnings: list[str] = []
    for key, value in values.items():
        flag_name = "--" + key.replace("_", "-")
        if key in leaves:
            kept[key] = value
            continue
        ours = RENAMED.get(flag_name)
        if ours is not None and ours[2:].replace("-", "_") in leaves:
            kept[ours[2:].replace("-", "_")] = value
            continue
        flag = by_name.get(flag_name)
        if flag is None:
            kept[key] = value
            continue
        status, note = classify(flag, frozenset("--" + leaf.replace("_", "-")
                                                for leaf in leaves))
        if status == "refused" and str(value) in HARMLESS_VALUES.get(flag.flag, set()):
            warnings.append(f"{source}: {flag_name[2:]}: {value}: accepted (vLLM's default; "
                            "nothing to do)")
        elif status == "accepted":
            warnings.append(f"{source}: {flag_name[2:]}: accepted and ignored ({note})")
        elif status == "refused":
            raise FlagError(f"{source}: {flag_name[2:]} is not supported: {note}")
        else:
            raise FlagError(f"{source}: {flag_name[2:]} is not available in this build yet "
                            f"({note})")
    return Translation([], warnings, kept)


def _take_values(args: list[str], i: int, nargs: int | str | None) -> tuple[int, list[str]]:
    """The values following a flag: one (nargs None), an int count, or as many as don't
    look like flags ('+', '*'); '?' takes one if it doesn't look like a flag."""
    if isinstance(nargs, int):
        return i + nargs, args[i:i + nargs]
    if nargs in ("+", "*"):
        j = i
        while j < len(args) and (not args[j].startswith("-") or _is_number(args[j])):
            j += 1
        return j, args[i:j]
    if nargs == "?" and (i >= len(args) or args[i].startswith("-")):
        return i, []
    return i + 1, args[i:i + 1]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# -- the table -------------------------------------------------------------------------------------
def table(ours: Iterable[str]) -> list[tuple[VllmFlag, str, str]]:
    ours = frozenset(ours)
    return [(flag, *classify(flag, ours)) for flag in vllm_flags()[1]]


def summary(ours: Iterable[str], markdown: bool = False) -> str:
    """The table as text (`jaxserve serve --help=vllm`) or as the README's markdown."""
    version, _ = vllm_flags()
    rows = table(ours)
    counts = {s: sum(1 for _, status, _ in rows if status == s)
              for s in ("implemented", "accepted", "refused", "unclassified")}
    head = (f"vLLM {version}'s `vllm serve` flags in jaxserve: {len(rows)} in all, "
            f"{counts['implemented']} implemented, {counts['accepted']} accepted with a "
            f"warning (no meaning here), {counts['refused']} refused with what to use "
            "instead")
    if counts["unclassified"]:
        head += f", {counts['unclassified']} UNCLASSIFIED"
    if not markdown:
        lines = [head + ".", ""]
        for status in ("implemented", "accepted", "refused"):
            lines.append(f"{status}:")
            for flag, s, note in rows:
                if s == status:
                    lines.append(f"  {flag.flag:<44} {note}".rstrip())
            lines.append("")
        return "\n".join(lines)
    lines = [head + ".", ""]
    implemented = [f"`{f.flag}`" + (f" (as `{n}`)" if n.startswith("--") else "")
                   for f, s, n in rows if s == "implemented" and not n.startswith("with ")]
    pending = [f"`{f.flag}`" for f, s, n in rows if s == "implemented" and n.startswith("with ")]
    lines.append("**Implemented** (same name, same meaning): " + ", ".join(implemented) + ".")
    if pending:
        lines.append(f"With the Hub download work: {', '.join(pending)}.")
    lines += ["", "**Accepted with a one-line warning**, by reason:", ""]
    for reason, flags in ACCEPTED.items():
        lines.append(f"- {reason}: {', '.join(f'`{f}`' for f in flags)}")
    lines += ["", "**Refused** with one error line (exit status 2) saying what to use "
              "instead; `1`-style no-op values (`--prefill-context-parallel-size 1`, "
              "`--api-server-count 1`, `--runner generate`...) are accepted:", "",
              "| flag | instead |", "|---|---|"]
    for flag, s, note in rows:
        if s == "refused":
            lines.append(f"| `{flag.flag}` | {note} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from jaxserve.entrypoints.cli import serve_option_strings

    argv = list(sys.argv[1:] if argv is None else argv)
    sys.stdout.write(summary(serve_option_strings(), markdown="--markdown" in argv) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
