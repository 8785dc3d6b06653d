"""Hugging Face transformers on the same machine as a peer: a random-weight model built from a
config directory, greedy, a fixed output length, eager PyTorch (bf16 on a GPU, float32 on
CPU). Writes tok/s per batch size as JSON, rewritten after each batch (a timeout keeps the
finished ones).

    python benchmarks/hf_peer.py configs/models/llama-3-8b out.json --batch-sizes 1,64,256 \\
        --output-len 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 64, 256])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(args.config_dir)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "init_s": time.perf_counter() - start,
              "output_len": args.output_len, "prompt_len": args.prompt_len, "runs": []}
    generator = torch.Generator().manual_seed(0)
    for batch in args.batch_sizes:
        ids = torch.randint(1, min(30000, config.vocab_size), (batch, args.prompt_len),
                            generator=generator).to(device)
        kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False,
                  "pad_token_id": 0}
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)     # warm-up
            sync()
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, **kwargs)
            sync()
            seconds = time.perf_counter() - start
        tokens = (out.shape[1] - ids.shape[1]) * batch
        result["runs"].append({"batch": batch, "tok_s": tokens / seconds, "seconds": seconds})
        print(f"HF batch {batch}: {tokens / seconds:.1f} tok/s ({seconds:.2f} s)", flush=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
