"""jaxserve: a JAX/XLA serving engine for LLMs."""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "jaxserve.entrypoints.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "RequestOutputKind": "jaxserve.sampling_params",
    "StructuredOutputsParams": "jaxserve.structured_outputs_params",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "EngineConfig": "jaxserve.config",
    "LoRARequest": "jaxserve.lora.request",
}


def __getattr__(name: str):
    # Lazy: `LLM` pulls in JAX and the model code; `import jaxserve` stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "EngineConfig", "LoRARequest", "__version__"]
