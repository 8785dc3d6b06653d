"""Which files of a Hub repo a model needs, chosen from the repo's listing before a byte moves.

    files = select_files(listing, "model", repo="org/name")        # [RemoteFile, ...]

A model is its ``*.safetensors`` (with ``model.safetensors.index.json``: only the shards the
index names), ``config.json``, ``generation_config.json``, the tokenizer files and the chat
template; never ``*.bin`` / ``*.pt`` / ``*.pth`` / ``original/`` / ``*.gguf`` / images when
safetensors exist. A GGUF repo gives one ``.gguf`` file (its tokenizer is inside), picked by a
quant tag (``org/name:Q4_K_M``, llama.cpp's ``-hf`` convention) or a file name.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                      "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                      "merges.txt", "*.tiktoken", "spiece.model")
CHAT_TEMPLATE_PATTERNS = ("chat_template.jinja", "chat_template.json",
                          "additional_chat_templates/*.jinja")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# What the file set is for: a whole model, its config alone (ahead-of-time compile), a
# tokenizer (--tokenizer org/other), a LoRA adapter.
KINDS = ("model", "config", "tokenizer", "adapter")


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file of a repo at a commit: its path, size, and the digest the Hub publishes for
    it (sha256 for large-file-storage files, else the git blob sha1), which is also the
    name of its blob in the Hugging Face cache."""
    path: str
    size: int
    sha256: str | None
    git_sha1: str | None

    @property
    def etag(self) -> str | None:
        return self.sha256 or self.git_sha1


def _top_level(files: Sequence[RemoteFile]) -> list[RemoteFile]:
    return [f for f in files if "/" not in f.path]


def _matching(files: Sequence[RemoteFile], patterns: Sequence[str]) -> list[RemoteFile]:
    return [f for f in files if any(fnmatch.fnmatchcase(f.path, p) for p in patterns)]


def _sizes(files: Sequence[RemoteFile]) -> str:
    return ", ".join(f"{f.path} ({f.size / 1e9:.2f} GB)" if f.size >= 1e8 else
                     f"{f.path} ({f.size / 1e6:.1f} MB)" for f in files)


def select_files(listing: Sequence[RemoteFile], kind: str, repo: str,
                 gguf_choice: str | None = None,
                 read_index: Callable[[RemoteFile], bytes] | None = None) -> list[RemoteFile]:
    """The files `kind` needs from `listing`, config and tokenizer first, weights last.

    gguf_choice: a quant tag (``Q4_K_M``) or a file name picking one ``.gguf``.
    read_index: fetches ``model.safetensors.index.json``'s bytes (needed only when the repo
    has one: its ``weight_map`` names the shards). ValueError when the repo holds no usable
    weights (only ``.bin`` / ``.pth``: the message names them), or several GGUF files and
    no choice (the message lists them).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown file set {kind!r}; choose one of {', '.join(KINDS)}")
    top = _top_level(listing)
    if kind == "adapter":
        return _adapter_files(top, repo)
    ggufs = [f for f in listing if f.path.endswith(".gguf")]
    safetensors = [f for f in top if f.path.endswith(".safetensors")]
    if gguf_choice is not None or (not safetensors and ggufs and kind != "tokenizer"):
        return [_pick_gguf(ggufs, gguf_choice, repo)]
    tokenizer = _matching(top, TOKENIZER_PATTERNS) + _matching(listing, CHAT_TEMPLATE_PATTERNS)
    config = [f for f in top if f.path in CONFIG_FILES]
    if kind == "config":
        return [f for f in config if f.path == "config.json"] or _no_config(repo)
    if kind == "tokenizer":
        # transformers reads config.json to choose some tokenizers' classes.
        return [f for f in config if f.path == "config.json"] + tokenizer
    if not safetensors:
        raise ValueError(_no_safetensors_message(listing, repo))
    if not any(f.path == "config.json" for f in config):
        _no_config(repo)
    return config + tokenizer + _weights(top, safetensors, repo, read_index)


def _no_config(repo: str) -> list[RemoteFile]:
    raise ValueError(f"the Hub repo {repo!r} has no config.json (not a transformers model)")


def _weights(top: list[RemoteFile], safetensors: list[RemoteFile], repo: str,
             read_index: Callable[[RemoteFile], bytes] | None) -> list[RemoteFile]:
    index = next((f for f in top if f.path == INDEX_FILE), None)
    if index is None:
        return safetensors
    if read_index is None:
        raise ValueError(f"{repo}: {INDEX_FILE} must be read to choose the shards")
    try:
        shard_names = set(json.loads(read_index(index))["weight_map"].values())
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{repo}: {INDEX_FILE} has no usable weight_map ({e})") from None
    by_name = {f.path: f for f in safetensors}
    missing = sorted(shard_names - set(by_name))
    if missing:
        raise ValueError(f"{repo}: {INDEX_FILE} names shards the repo does not hold: "
                         f"{', '.join(missing)}")
    return [index] + [by_name[name] for name in sorted(shard_names)]


def _adapter_files(top: list[RemoteFile], repo: str) -> list[RemoteFile]:
    chosen = [f for f in top if f.path in ADAPTER_FILES]
    if len(chosen) == len(ADAPTER_FILES):
        return chosen
    bins = [f.path for f in top if f.path.endswith((".bin", ".pt"))]
    raise ValueError(f"the Hub repo {repo!r} is not a PEFT LoRA adapter with safetensors "
                     f"weights (it needs {' and '.join(ADAPTER_FILES)}"
                     + (f"; it has {', '.join(bins)}, which jaxserve does not read: save the "
                        "adapter with safe_serialization=True" if bins else "") + ")")


def _no_safetensors_message(listing: Sequence[RemoteFile], repo: str) -> str:
    pickled = [f for f in listing if f.path.endswith((".bin", ".pt", ".pth"))]
    if pickled:
        return (f"the Hub repo {repo!r} has no .safetensors weights, only pickled PyTorch "
                f"files ({_sizes(pickled)}), which jaxserve does not load (they can run code "
                "when read): convert them to safetensors (transformers' "
                "save_pretrained(..., safe_serialization=True)), then serve that directory")
    return f"the Hub repo {repo!r} holds no model weights (.safetensors or .gguf)"


def _pick_gguf(ggufs: list[RemoteFile], choice: str | None, repo: str) -> RemoteFile:
    names = ", ".join(f.path for f in ggufs)
    if not ggufs:
        raise ValueError(f"a GGUF file was asked for ({choice}), but the Hub repo {repo!r} "
                         "holds no .gguf file")
    if choice is None:
        if len(ggufs) == 1:
            return ggufs[0]
        raise ValueError(f"the Hub repo {repo!r} holds {len(ggufs)} GGUF files ({names}); "
                         f"pick one as {repo}:QUANT (e.g. {repo}:Q4_K_M) or --gguf-file NAME")
    exact = [f for f in ggufs if choice in (f.path, f.path.rsplit("/", 1)[-1])]
    tagged = exact or [f for f in ggufs if choice.lower() in f.path.rsplit("/", 1)[-1].lower()]
    if len(tagged) == 1:
        return tagged[0]
    if not tagged:
        raise ValueError(f"no GGUF file of the Hub repo {repo!r} matches {choice!r}; it holds "
                         f"{names}")
    raise ValueError(f"{choice!r} matches {len(tagged)} GGUF files of the Hub repo {repo!r} "
                     f"({', '.join(f.path for f in tagged)}); name one file with --gguf-file "
                     "(split GGUF files are not supported)")
