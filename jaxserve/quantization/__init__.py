"""Quantized weights (`--quantization`): what each mode stores and how a layer reads it.

    None    unset: a GGUF file stays packed where the CPU's block kernels read it
            (engine/gguf_packing.py), else as none
    none    weights in --dtype (a GGUF file is dequantized at load)
    int8    w8a16: every projection kernel int8 [in, out] + a float32 `scale` [in / 32, out],
            one per 32 input rows of each output column, quantized at load from any float
            checkpoint (int8.py)
    gguf    a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K tensors stay packed in device
            memory (the raw llama.cpp blocks), read in place by the CPU's block kernels
            (kernels/cpu/gemv_gguf.h), elsewhere dequantized inside the jitted matmul
            (gguf_packed.py)
    awq     an AWQ checkpoint's int4 projections (config.json's quantization_config picks it)
    gptq    a GPTQ checkpoint's int4 / int8 projections, act-order too: both stay packed
            (int32 words + float16 scales and zeros per group) and are dequantized inside
            the jitted matmul (awq_gptq.py)

The linen modules in models/layers.py (`Linear`, `Embedding`) pick the path from the
parameter tree itself (which leaf names are present), so every family gets every mode.
"""

QUANTIZATION_MODES = ("int8", "gguf", "awq", "gptq")


def check_mode(mode: str | None) -> str | None:
    if mode in (None, "none"):
        return None
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of "
                         f"{', '.join(QUANTIZATION_MODES)} (or none)")
    return mode
