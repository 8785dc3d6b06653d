"""A GGUF file's tokenizer loads without torch (the container image has none), with the
fields transformers' own (torch-importing) GGUF reader gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.fast
def test_tokenizer_fields_equal_transformers_get_gguf_tokenizer(default_gguf_path):
    from transformers.integrations.gguf import get_gguf_tokenizer

    from jaxserve.loader.gguf_loader import gguf_tokenizer_fields, open_gguf

    ours = gguf_tokenizer_fields(open_gguf(str(default_gguf_path)))
    assert ours == get_gguf_tokenizer(str(default_gguf_path))
    assert len(ours[1]["tokens"]) > 1000 and ours[2]["eos_token"]


@pytest.mark.fast
def test_gguf_tokenizer_loads_where_torch_cannot_be_imported(default_gguf_path):
    from jaxserve.loader.gguf_loader import gguf_tokenizer

    expected = gguf_tokenizer(default_gguf_path).encode("Hello, world!")
    code = ("import sys, json; sys.modules['torch'] = None\n"   # import torch -> ImportError
            "from jaxserve.loader.gguf_loader import gguf_tokenizer\n"
            f"t = gguf_tokenizer({str(default_gguf_path)!r})\n"
            "print(json.dumps([t.encode('Hello, world!'), 'torch' in sys.modules and "
            "sys.modules['torch'] is not None]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    ids, torch_loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert ids == expected and not torch_loaded
