"""A word-level tokenizer covering a model's whole vocabulary, for serving benchmarks of
--load-format dummy models that come without one (configs/models/llama-3-8b).

Token i is the word "t{i}" (decoded with a space before it), so every generated id, of the
full vocabulary, streams a piece of text: the server's detokenizer, SSE chunks and a
client's TTFT / ITL timing all run as with a real tokenizer. Written as a Hugging Face
directory (tokenizer.json + tokenizer_config.json + the model's config.json) for
--tokenizer DIR.

    python benchmarks/synthetic_tokenizer.py configs/models/llama-3-8b /tmp/tok
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_synthetic_tokenizer(model_dir: Path, out: Path) -> int:
    """Write the tokenizer for model_dir's config.json vocab_size to `out`; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Every token decodes to " t{i}": the word plus its separating space.
    tokenizer.decoder = decoders.Replace("t", " t")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0",
                                   eos_token=f"t{eos}" if eos is not None else None)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    # jaxserve resolves a tokenizer directory like a model directory: by its config.json
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a directory with config.json")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    size = write_synthetic_tokenizer(args.model_dir, args.out)
    print(f"wrote a {size}-token word-level tokenizer to {args.out}")


if __name__ == "__main__":
    main()
