"""API keys: who may call the server, which models each key may use, and its limits.

Keys come from `--api-key` (any number; every model, no limit) and `--api-keys-file`:

    keys:
      - key: sk-team-a            # or  sha256: <hex of the key>, so the file holds no secret
        models: [smol, sql-lora]  # served model names / adapter names; "*" (or no models) for all
        requests_per_minute: 60   # optional; no limit when absent
        tokens_per_minute: 20000  # prompt + completion; optional
        name: team-a              # optional: the key's name in logs and rate-limit counters

Only SHA-256 digests are kept in memory; a presented key is hashed and compared with every
digest by `hmac.compare_digest` (constant time, and no early exit, so the time taken does not
say which key matched or how many there are). A key is never logged: logs name a key by its
`name`, else the first 8 hex digits of its digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Iterable

logger = logging.getLogger(__name__)

ALL_MODELS = "*"
_FIELDS = {"key", "sha256", "models", "requests_per_minute", "tokens_per_minute", "name"}


@dataclasses.dataclass(frozen=True)
class APIKey:
    """One key's rights. `digest` is the SHA-256 of the key (bytes); `models` None: all."""
    digest: bytes
    name: str
    models: frozenset[str] | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def parse_keys_file(path: str | os.PathLike) -> list[APIKey]:
    """The keys of a keys file; ValueError naming the file and entry for anything wrong."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ValueError(f"{path}: expected a mapping with a 'keys' list")
    keys = [_parse_entry(entry, f"{path}: keys[{i}]") for i, entry in enumerate(data["keys"])]
    digests = [k.digest for k in keys]
    if len(set(digests)) != len(digests):
        raise ValueError(f"{path}: the same key appears twice")
    return keys


def _parse_entry(entry: object, where: str) -> APIKey:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: "
                         f"{sorted(_FIELDS)}")
    if ("key" in entry) == ("sha256" in entry):
        raise ValueError(f"{where}: give exactly one of 'key' or 'sha256'")
    if "key" in entry:
        if not isinstance(entry["key"], str) or not entry["key"]:
            raise ValueError(f"{where}: 'key' must be a non-empty string")
        digest = key_digest(entry["key"])
    else:
        text = str(entry["sha256"]).strip().lower()
        try:
            digest = bytes.fromhex(text)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: 'sha256' must be 64 hex digits (sha256sum of the key)")
    models = entry.get("models")
    if models is not None:
        if isinstance(models, str):
            models = [models]
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ValueError(f"{where}: 'models' must be a list of model names")
        models = None if ALL_MODELS in models else frozenset(models)
    limits = {}
    for field in ("requests_per_minute", "tokens_per_minute"):
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ValueError(f"{where}: '{field}' must be an integer >= 0, got {value!r}")
        limits[field] = value
    name = entry.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}: 'name' must be a string")
    return APIKey(digest=digest, name=name or f"key-{digest.hex()[:8]}", models=models,
                  **limits)


class KeyTable:
    """The keys the server accepts; `reload()` re-reads the keys file (SIGHUP)."""

    def __init__(self, plain_keys: Iterable[str] = (), keys_file: str | None = None) -> None:
        self.plain_keys = [APIKey(digest=key_digest(k), name=f"key-{key_digest(k).hex()[:8]}")
                           for k in plain_keys]
        self.keys_file = keys_file
        self._lock = threading.Lock()
        self._keys: tuple[APIKey, ...] = ()
        self.reload()

    def reload(self) -> None:
        """Read the keys file again. A broken file keeps the keys in force (logged)."""
        keys = list(self.plain_keys)
        if self.keys_file is not None:
            try:
                keys += parse_keys_file(self.keys_file)
            except (OSError, ValueError) as exc:
                if not self._keys:
                    raise ValueError(str(exc)) from None     # at start: refuse to run
                logger.error("keeping the previous API keys: %s", exc)
                return
        with self._lock:
            self._keys = tuple(keys)
        logger.info("API keys: %d in force%s", len(keys),
                    f" ({self.keys_file})" if self.keys_file else "")

    def __len__(self) -> int:
        return len(self._keys)

    def lookup(self, presented: bytes) -> APIKey | None:
        """The key whose digest equals SHA-256(presented); every digest is compared."""
        digest = key_digest(presented)
        found = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key
        return found
