"""Read a llama.cpp GGUF file (weights, config and tokenizer) into our layout.

Quantized tensors (Q4_1, Q8_0, Q4_K, ...) are dequantized with ``gguf.quants``, or kept
packed (the file's blocks, quantization/gguf_packed.py) for the block kernels.
GGUF lists dimensions fastest-moving first (ggml's ``ne``); the reader's numpy
arrays are already in row-major order, i.e. Hugging Face's ``[out, in]``.
What llama.cpp's converter changed per architecture (Llama's q/k row permutation,
Gemma's norm + 1) the model's family undoes (`ModelFamily.from_gguf`); which GGUF
architectures exist, and their tensor names, is the registry's.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxserve.loader.weights import StackedWeights, parse_name
from jaxserve.models.registry import gguf_family, read_arch
from jaxserve.quantization.gguf_packed import PACKED_FORMATS

logger = logging.getLogger(__name__)

# GGUF key (after "{arch}.") -> config attribute
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}


def _reader_class() -> type:
    import gguf

    class PlainArrayGGUFReader(gguf.GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map.

        Slicing an ``np.memmap`` runs Python-level ``__array_finalize__`` each time; the
        reader slices ~250k times for a 49k-token vocabulary, which makes it 4x slower.
        """

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = np.asarray(value)

    return PlainArrayGGUFReader


def open_gguf(path: str | os.PathLike) -> Any:
    """A ``gguf.GGUFReader`` for `path`; a corrupt or truncated file raises ValueError naming it."""
    path = str(path)
    try:
        return _reader_class()(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        raise ValueError(f"{path}: not a valid GGUF file, or truncated ({type(e).__name__}: {e})") \
            from None


def metadata_value(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value as a Python scalar, string or list."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: Any, path: str) -> str:
    arch = metadata_value(reader, "general.architecture")
    file_family(reader, path)   # raises, listing the supported ones, if no family reads it
    return arch


def file_family(reader: Any, path: str) -> Any:
    """The model family that reads this file (by its architecture and metadata)."""
    arch = metadata_value(reader, "general.architecture")
    return gguf_family(arch, path,
                       lambda key, default=None: metadata_value(reader, f"{arch}.{key}", default))


def gguf_config(reader: Any, path: str) -> Any:
    """The transformers config (LlamaConfig, Gemma2Config, ...) a GGUF file describes."""
    import transformers

    arch = gguf_architecture(reader, path)
    family = file_family(reader, path)
    hf_architecture, config_class = family.gguf_architectures[arch]
    kwargs: dict[str, Any] = {}
    for key, attribute in _CONFIG_KEYS.items():
        value = metadata_value(reader, f"{arch}.{key}")
        if value is not None:
            kwargs[attribute] = value
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if "vocab_size" not in kwargs and tokens is not None:
        kwargs["vocab_size"] = len(tokens.data)
    if "head_dim" not in kwargs:
        rope_dims = metadata_value(reader, f"{arch}.rope.dimension_count")
        kwargs["head_dim"] = rope_dims or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    kwargs["rope_parameters"] = _rope_parameters(reader, arch, path)
    kwargs |= family.gguf_config(
        arch, lambda key, default=None: metadata_value(reader, f"{arch}.{key}", default))
    names = {t.name for t in reader.tensors}
    kwargs["tie_word_embeddings"] = "output.weight" not in names  # llama.cpp omits a tied head
    for special in ("bos", "eos"):
        token_id = metadata_value(reader, f"tokenizer.ggml.{special}_token_id")
        if token_id is not None:
            kwargs[f"{special}_token_id"] = token_id
    pad_id = metadata_value(reader, "tokenizer.ggml.padding_token_id")
    if pad_id is not None:
        kwargs["pad_token_id"] = pad_id
    config = getattr(transformers, config_class)(architectures=[hf_architecture], **kwargs)
    return config


def _rope_parameters(reader: Any, arch: str, path: str) -> dict[str, Any]:
    theta = metadata_value(reader, f"{arch}.rope.freq_base", 10000.0)
    scaling = metadata_value(reader, f"{arch}.rope.scaling.type")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1+ files store per-frequency factors instead of the llama3 rope parameters.
        raise ValueError(f"{path}: GGUF files with a rope_freqs tensor (Llama 3.1-style rope "
                         "scaling) are not supported yet; use the Hugging Face checkpoint")
    if scaling in (None, "none"):
        return {"rope_type": "default", "rope_theta": float(theta)}
    if scaling in ("linear", "yarn"):
        params = {"rope_type": scaling, "rope_theta": float(theta),
                  "factor": float(metadata_value(reader, f"{arch}.rope.scaling.factor", 1.0))}
        original = metadata_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            params["original_max_position_embeddings"] = int(original)
        return params
    raise ValueError(f"{path}: rope scaling type {scaling!r} is not supported (linear, yarn)")


def _packable(name: str) -> bool:
    """Tensors a packed format may stand in for: projections and the embedding / LM head.
    Not the stacked experts (``layers.experts_gate_proj.kernel``, [E, in, out] a layer,
    models/moe.py): the grouped expert matmul reads plain kernels, so quantized
    ``ffn_*_exps`` tensors are dequantized like any other unpacked tensor."""
    if ".experts_" in f".{name}":
        return False
    return name.endswith(".kernel") or name in ("embed_tokens", "lm_head")


def _packed_groups(reader: Any, family: Any) -> dict[str, str]:
    """Our tensor name -> packed format, for every packable tensor whose layers all hold
    one supported packed type (a name with mixed or other types is dequantized)."""
    types: dict[str, set[str]] = {}
    for tensor in reader.tensors:
        parsed = parse_name(tensor.name, "gguf", family)
        if parsed is not None and _packable(parsed[0]):
            types.setdefault(parsed[0], set()).add(tensor.tensor_type.name.lower())
    return {name: next(iter(t)) for name, t in types.items()
            if len(t) == 1 and next(iter(t)) in PACKED_FORMATS}


def load_gguf_weights(reader: Any, hf_config: Any, dtype: np.dtype,
                      path: str, keep_packed: bool = False,
                      float_copy_budget: int = 0) -> dict[str, np.ndarray]:
    """All weights of a GGUF file in our stacked layout: dequantized into `dtype`, or with
    keep_packed, Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K projections and embeddings as their raw blocks
    (``layers.q_proj.q4_1`` uint8 [L, out, packed bytes]; quantization/gguf_packed.py).
    float_copy_budget: with keep_packed, also the packed tensors dequantized into `dtype`
    (``layers.q_proj.kernel`` beside ``layers.q_proj.q4_1``: steps of many rows read those,
    models/linear_method.GGUFPackedMethod) when they take at most this many bytes."""
    from gguf.quants import dequantize

    gguf_arch = gguf_architecture(reader, path)
    family = file_family(reader, path)
    arch = read_arch(hf_config)
    packed_names = _packed_groups(reader, family) if keep_packed else {}
    copy_bytes = _float_bytes(reader, family, packed_names, dtype)
    float_copy = bool(packed_names) and 0 < copy_bytes <= float_copy_budget
    if packed_names and float_copy_budget:
        logger.info("GGUF packed tensors: %s float copy (%.1f MiB in %s) for steps of many "
                    "rows (budget %.1f MiB)", "with a" if float_copy else "without the",
                    copy_bytes / 2**20, np.dtype(dtype).name, float_copy_budget / 2**20)
    shapes = {n: s for n, s in family.weight_shapes(arch).items()
              if float_copy or n not in packed_names}
    stacked = StackedWeights(shapes, dtype, source=path)
    packed: dict[str, np.ndarray] = {}
    unexpected, wanted = [], []
    for tensor in reader.tensors:
        parsed = parse_name(tensor.name, "gguf", family)
        if parsed is not None and parsed[0] in packed_names:
            name, layer = parsed
            rows = family.from_gguf(name, np.asarray(tensor.data), arch, gguf_arch)
            key = f"{name.removesuffix('.kernel')}.{packed_names[name]}"
            if layer is None:
                packed[key] = np.ascontiguousarray(rows)
            else:
                if key not in packed:
                    packed[key] = np.empty((arch.num_layers, *rows.shape), np.uint8)
                packed[key][layer] = rows
            if not float_copy:
                continue
        if parsed is None or not stacked.wants(parsed[0]):
            if tensor.name != "output.weight" or not arch.tie_word_embeddings:
                unexpected.append(tensor.name)
            continue
        wanted.append((tensor, parsed))

    def load_one(item: tuple[Any, tuple[str, int | None]]) -> None:
        tensor, (name, layer) = item
        try:
            weight = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path}: cannot dequantize {tensor.name} of type "
                             f"{tensor.tensor_type.name}: {e}") from None
        weight = family.from_gguf(name, weight, arch, gguf_arch)
        stacked.put(name, layer, weight, origin=f"{tensor.name} in {path}")

    # numpy releases the GIL in dequantization and the transposing copies, so threads
    # scale them over cores; each tensor writes its own slice of the stacked arrays.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(load_one, wanted))
    if unexpected:
        raise ValueError(f"{path}: GGUF has tensors this loader does not know how to use: "
                         f"{unexpected[:8]}")
    return stacked.finish() | packed


def _float_bytes(reader: Any, family: Any, packed_names: dict[str, str], dtype: Any) -> int:
    """Bytes the packed tensors take dequantized into dtype."""
    count = 0
    for tensor in reader.tensors:
        parsed = parse_name(tensor.name, "gguf", family)
        if parsed is not None and parsed[0] in packed_names:
            count += int(tensor.n_elements)
    return count * np.dtype(dtype).itemsize


# The string arrays transformers' GGUF tokenizer reader returns whole; it gives any other
# string array as its length (gguf_tokenizer_fields reads them the same way).
_WHOLE_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def gguf_tokenizer_fields(reader: Any) -> tuple[str, dict, dict]:
    """`(architecture, tokenizer_dict, tokenizer_config)` as transformers'
    `get_gguf_tokenizer` returns them, read with the gguf package: transformers' GGUF metadata
    reader imports torch (for tensor dtypes), and the server runs without torch."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    def value(key: str) -> Any:
        found = metadata_value(reader, key)
        if isinstance(found, list) and found and isinstance(found[0], str) \
                and key not in _WHOLE_ARRAYS:
            return len(found)
        return found

    grouped = {group: {name: found for key, name in renames.items()
                       if (found := value(f"tokenizer.{key}")) is not None}
               for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    # transformers' rules for BOS by tokenizer type, as get_gguf_tokenizer applies them.
    if tokenizer.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":
        tokenizer_config["add_bos_token"] = False
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = metadata_value(reader, f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return metadata_value(reader, "general.architecture"), tokenizer, tokenizer_config


def gguf_tokenizer(path: str | os.PathLike, reader: Any = None) -> Any:
    """The Hugging Face fast tokenizer a GGUF file describes, with its chat template."""
    import transformers

    path = str(path)
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, gguf_tokenizer_mapping
        gguf_tokenizer_mapping._SPECIAL_TOKENS  # noqa: B018  (the names the fields need)
    except (ImportError, AttributeError):  # older transformers: the public (slower) route
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    else:
        # What AutoTokenizer.from_pretrained(dir, gguf_file=...) does, minus its second
        # full parse of the file to build a model config it does not need.
        reader = reader or open_gguf(path)
        architecture, tokenizer_dict, tokenizer_config = gguf_tokenizer_fields(reader)
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, name_or_path=path, **tokenizer_config, **extra)
    if not getattr(tokenizer, "chat_template", None):
        template = metadata_value(reader or open_gguf(path), "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    return tokenizer
