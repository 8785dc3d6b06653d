"""The repos the loopback Hub (tests/hub_server.py) serves in the tests, laid out in a folder.

    populate(root, make_tiny_model("llama"), make_tiny_model("llama", intermediate_size=96))
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Files beside the safetensors that a download must never request.
DECOYS = {"pytorch_model.bin": 3000, "original/consolidated.pth": 3000, "README.md": 200,
          "assets/logo.png": 500, "tiny-llama.Q4_K_M.gguf": 800}


def _copy_model(source: Path, dest: Path, decoys: bool = True) -> None:
    shutil.copytree(source, dest)
    if decoys:
        for name, size in DECOYS.items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(bytes(range(256)) * (size // 256) + name.encode())


def _shard(model_dir: Path, dest: Path) -> None:
    """`model_dir` with its weights split in two shards + an index, and a decoy
    ``consolidated.safetensors`` the index does not name."""
    from safetensors.numpy import load_file, save_file

    _copy_model(model_dir, dest)
    tensors = load_file(dest / "model.safetensors")
    (dest / "model.safetensors").rename(dest / "consolidated.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dest / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (dest / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
         "weight_map": weight_map}))


def populate(root: Path, model_dir: Path, other_model_dir: Path) -> Path:
    """The test repos under `root`:

    tiny-org/tiny-llama      main: `model_dir` + DECOYS; branch "other": `other_model_dir`
    tiny-org/tiny-sharded    `model_dir` as two shards + index (+ a decoy consolidated file)
    tiny-org/gated           `model_dir`, gated (serve it with gated={"tiny-org/gated"})
    tiny-org/bin-only        config.json + pytorch_model.bin
    tiny-org/two-ggufs       two .gguf files
    """
    repos = root / "tiny-org"
    _copy_model(model_dir, repos / "tiny-llama" / "main")
    _copy_model(other_model_dir, repos / "tiny-llama" / "other", decoys=False)
    _shard(model_dir, repos / "tiny-sharded" / "main")
    _copy_model(model_dir, repos / "gated" / "main", decoys=False)
    bin_only = repos / "bin-only" / "main"
    bin_only.mkdir(parents=True)
    shutil.copy(model_dir / "config.json", bin_only / "config.json")
    (bin_only / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    ggufs = repos / "two-ggufs" / "main"
    ggufs.mkdir(parents=True)
    for quant in ("Q4_K_M", "Q8_0"):
        (ggufs / f"tiny.{quant}.gguf").write_bytes(quant.encode() * 100)
    return root


def build_tiny_models(directory: Path, hidden_size: int = 64) -> tuple[Path, Path]:
    """Two tiny random Llamas (as conftest's make_tiny_model writes them), for running this
    Hub outside pytest: (main's model, the "other" branch's model)."""
    import torch
    import transformers

    from tests.conftest import _build_tiny_tokenizer, _randomize_norms_and_biases, _tiny_config

    tokenizer = _build_tiny_tokenizer(directory / "tokenizer")
    made = []
    for name, intermediate in (("main", 2 * hidden_size), ("other", hidden_size + 32)):
        config = _tiny_config("llama", len(tokenizer), {"hidden_size": hidden_size,
                                                        "intermediate_size": intermediate})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize_norms_and_biases(model)
        model.save_pretrained(directory / name)
        transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 0],
                                      pad_token_id=2).save_pretrained(directory / name)
        tokenizer.save_pretrained(directory / name)
        made.append(directory / name)
    return made[0], made[1]
