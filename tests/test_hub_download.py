"""Models by name from the Hugging Face Hub, against a Hub on loopback (tests/hub_server.py).

The `hub` fixture (conftest) serves tiny-org/* repos and points HF_ENDPOINT at it, and
HF_HUB_CACHE at a fresh folder; `hub.requests` is everything the client asked for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxserve.loader.hub_download import HubError, HubOptions, fetch_from_hub
from jaxserve.loader.hub_files import RemoteFile, select_files
from jaxserve.loader.hub_lock import DownloadLock
from jaxserve.loader.resolve import resolve_model
from tests import hub_server, precision

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "model.safetensors"}
DECOY_MARKERS = (".bin", ".pth", "original/", "README", ".png", ".gguf", "consolidated")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _downloaded(hub: hub_server.HubServer, repo: str) -> list[str]:
    return [name[len(repo) + 1:] for name in hub.downloads() if name.startswith(repo + "/")]


def _env(hub: hub_server.HubServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


# -- the file set -----------------------------------------------------------------------------
@pytest.mark.fast
def test_download_requests_safetensors_config_and_tokenizer_only(hub, hub_repos):
    snapshot = Path(resolve_model("tiny-org/tiny-llama").path)
    assert sorted(_downloaded(hub, "tiny-org/tiny-llama")) == sorted(MODEL_FILES)
    requested = [r.path for r in hub.requests]
    assert not [p for p in requested if any(m in p for m in DECOY_MARKERS)], requested
    source = hub_repos / "tiny-org" / "tiny-llama" / "main"
    assert _sha256(snapshot / "model.safetensors") == _sha256(source / "model.safetensors")
    # A second resolve is the cache's: no request at all.
    before = len(hub.requests)
    assert resolve_model("tiny-org/tiny-llama").path == str(snapshot)
    assert len(hub.requests) == before


@pytest.mark.fast
def test_sharded_repo_fetches_only_the_shards_its_index_names(hub):
    snapshot = Path(resolve_model("tiny-org/tiny-sharded").path)
    fetched = set(_downloaded(hub, "tiny-org/tiny-sharded"))
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "model.safetensors.index.json"} <= fetched
    assert "consolidated.safetensors" not in fetched
    assert not (snapshot / "consolidated.safetensors").exists()


@pytest.mark.fast
def test_revision_picks_the_other_branch_weights(hub, hub_repos):
    main = Path(resolve_model("tiny-org/tiny-llama").path)
    other = Path(resolve_model("tiny-org/tiny-llama", HubOptions(revision="other")).path)
    assert other != main and other.name == hub.commit("tiny-org/tiny-llama", "other")
    source = hub_repos / "tiny-org" / "tiny-llama" / "other" / "model.safetensors"
    assert _sha256(other / "model.safetensors") == _sha256(source)
    assert _sha256(other / "model.safetensors") != _sha256(main / "model.safetensors")
    refs = other.parents[1] / "refs"
    assert (refs / "other").read_text() == other.name


@pytest.mark.fast
def test_selection_refuses_pickled_only_repos_and_ambiguous_ggufs():
    def listing(*names: str) -> list[RemoteFile]:
        return [RemoteFile(n, 10, None, None) for n in names]

    with pytest.raises(ValueError, match=r"only pickled PyTorch files \(pytorch_model.bin"):
        select_files(listing("config.json", "pytorch_model.bin"), "model", "o/m")
    with pytest.raises(ValueError, match="a.Q4_K_M.gguf, a.Q8_0.gguf"):
        select_files(listing("a.Q4_K_M.gguf", "a.Q8_0.gguf"), "model", "o/m")
    [picked] = select_files(listing("a.Q4_K_M.gguf", "a.Q8_0.gguf"), "model", "o/m", "q8_0")
    assert picked.path == "a.Q8_0.gguf"
    chosen = select_files(listing("config.json", "model.safetensors", "original/x.pth",
                                  "pytorch_model.bin", "m.gguf"), "config", "o/m")
    assert [f.path for f in chosen] == ["config.json"]


@pytest.mark.fast
def test_gguf_repo_by_quant_tag_fetches_one_file(hub):
    path = Path(resolve_model("tiny-org/two-ggufs:Q8_0").path)
    assert path.name == "tiny.Q8_0.gguf"
    assert _downloaded(hub, "tiny-org/two-ggufs") == ["tiny.Q8_0.gguf"]
    with pytest.raises(HubError, match="tiny.Q4_K_M.gguf, tiny.Q8_0.gguf"):
        fetch_from_hub("tiny-org/two-ggufs", "model",
                       HubOptions(cache_dir=str(Path(os.environ["HF_HUB_CACHE"]) / "fresh")))


@pytest.mark.fast
def test_compile_needs_config_json_only(hub):
    from jaxserve.loader import read_model_config

    hf_config, _ = read_model_config("tiny-org/tiny-llama")
    assert hf_config.hidden_size == 64
    assert _downloaded(hub, "tiny-org/tiny-llama") == ["config.json"]


@pytest.mark.fast
def test_lora_adapter_by_name_fetches_its_config_and_safetensors_only(hub):
    import transformers

    from jaxserve.lora.peft_loader import load_peft_adapter
    from jaxserve.models.registry import family_for, read_arch

    base = resolve_model("tiny-org/tiny-llama").path
    arch = read_arch(transformers.AutoConfig.from_pretrained(base))
    weights = load_peft_adapter("tiny-org/tiny-adapter", family_for(arch.architecture), arch,
                                max_lora_rank=8, hub=HubOptions())
    assert weights.rank == 4 and weights.a
    assert sorted(_downloaded(hub, "tiny-org/tiny-adapter")) == [
        "adapter_config.json", "adapter_model.safetensors"]


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.fast
def test_gated_repo_needs_a_token_and_no_weight_byte_moves_without_one(hub):
    with pytest.raises(HubError, match=r"gated model and no token was given \(401\).*HF_TOKEN"):
        fetch_from_hub("tiny-org/gated")
    with pytest.raises(HubError, match=r"refused for it \(403\)"):
        fetch_from_hub("tiny-org/gated", options=HubOptions(token="hf_wrong"))
    assert _downloaded(hub, "tiny-org/gated") == []
    snapshot = fetch_from_hub("tiny-org/gated", options=HubOptions(token=hub_server.TOKEN))
    assert (snapshot / "model.safetensors").is_file()


@pytest.mark.fast
def test_unknown_repo_and_revision_say_what_is_wrong(hub):
    with pytest.raises(HubError, match=rf"{hub.endpoint} \(HF_ENDPOINT\) has no model repo "
                                       r"'tiny-org/nope'"):
        fetch_from_hub("tiny-org/nope")
    with pytest.raises(HubError, match="has no revision 'v9'"):
        fetch_from_hub("tiny-org/tiny-llama", options=HubOptions(revision="v9"))


def test_cli_errors_are_one_line_and_quick(hub):
    for name, expected in (("tiny-org/does-not-exist", "has no model repo"),
                           ("tiny-org/gated", "gated model")):
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli", "download",
                               name], capture_output=True, text=True, env=_env(hub), cwd=ROOT,
                              timeout=60)
        assert done.returncode != 0
        assert "Traceback" not in done.stderr
        errors = [line for line in done.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and expected in errors[0], done.stderr
        assert time.monotonic() - start < 30


# -- offline and the cache --------------------------------------------------------------------
@pytest.mark.fast
def test_offline_uses_the_cache_with_the_hub_stopped(hub, monkeypatch):
    snapshot = resolve_model("tiny-org/tiny-llama").path
    hub.stop()
    assert resolve_model("tiny-org/tiny-llama").path == snapshot     # cache first, no network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("tiny-org/tiny-llama").path == snapshot
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set and tiny-org/tiny-sharded@main "
                                       "is not in the cache"):
        resolve_model("tiny-org/tiny-sharded")


@pytest.mark.fast
def test_no_network_and_no_cache_mentions_hf_hub_offline(hub, monkeypatch):
    hub.stop()
    with pytest.raises(HubError, match="cannot reach the Hub.*HF_HUB_OFFLINE=1"):
        fetch_from_hub("tiny-org/tiny-llama")


@pytest.mark.fast
def test_corrupt_cached_shard_is_named_and_fetched_again(hub, monkeypatch, caplog):
    snapshot = Path(resolve_model("tiny-org/tiny-sharded").path)
    shard = snapshot / "model-00002-of-00002.safetensors"
    good = _sha256(shard)
    blob = Path(os.path.realpath(shard))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))           # same size, one byte flipped
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="model-00002-of-00002.safetensors in the cache was "
                                       "corrupt"):
        resolve_model("tiny-org/tiny-sharded")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    caplog.set_level(logging.WARNING)
    assert Path(resolve_model("tiny-org/tiny-sharded").path) == snapshot
    assert _sha256(shard) == good
    fetched = _downloaded(hub, "tiny-org/tiny-sharded")
    assert fetched.count("model-00002-of-00002.safetensors") == 2
    assert fetched.count("model-00001-of-00002.safetensors") == 1


@pytest.mark.fast
def test_missing_shard_is_never_loaded_and_is_fetched_again(hub, monkeypatch):
    snapshot = Path(resolve_model("tiny-org/tiny-sharded").path)
    shard = snapshot / "model-00001-of-00002.safetensors"
    os.unlink(os.path.realpath(shard))
    shard.unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="model-00001-of-00002.safetensors"):
        resolve_model("tiny-org/tiny-sharded")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    resolve_model("tiny-org/tiny-sharded")
    assert shard.is_file()
    assert _downloaded(hub, "tiny-org/tiny-sharded").count(shard.name) == 2


@pytest.mark.fast
def test_download_cut_halfway_resumes_and_ends_verified(hub, hub_repos, monkeypatch):
    from huggingface_hub import constants

    # The client writes whole chunks (10 MiB by default): smaller ones, so that the bytes
    # before the cut of this 0.5 MB file are on disk and the retry asks for the rest.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 << 10)
    hub.drop_once.add("tiny-org/tiny-llama/model.safetensors")
    snapshot = Path(resolve_model("tiny-org/tiny-llama").path)
    gets = [r for r in hub.requests
            if r.method == "GET" and r.path.endswith("/model.safetensors")]
    assert len(gets) == 2 and gets[0].range is None
    assert gets[1].range is not None and gets[1].range.startswith("bytes=")
    assert int(gets[1].range[len("bytes="):].split("-")[0]) > 0      # resumed, not restarted
    source = hub_repos / "tiny-org" / "tiny-llama" / "main" / "model.safetensors"
    assert _sha256(snapshot / "model.safetensors") == _sha256(source)


def test_download_interrupted_by_ctrl_c_resumes_in_the_next_process(hub, hub_repos):
    import signal

    hub.stall_once.add("tiny-org/tiny-llama/model.safetensors")
    # Ctrl-C's default meaning in the child: a test run started in the background (nohup,
    # `cmd &` in a script) hands its children SIGINT ignored, and the signal would do nothing.
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from huggingface_hub import constants; constants.DOWNLOAD_CHUNK_SIZE = 1 << 14; "
            "from jaxserve.loader.hub_download import fetch_from_hub; "
            "fetch_from_hub('tiny-org/tiny-llama')")
    # A read timeout longer than the test: huggingface_hub retries a stalled read after
    # HF_HUB_DOWNLOAD_TIMEOUT (10 s) with a Range request the Hub then answers in full, and
    # the process would finish before the Ctrl-C on a slow box.
    proc = subprocess.Popen([sys.executable, "-c", code],
                            env={**_env(hub), "HF_HUB_DOWNLOAD_TIMEOUT": "300"}, cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    source = hub_repos / "tiny-org" / "tiny-llama" / "main" / "model.safetensors"
    size = source.stat().st_size
    blobs = Path(os.environ["HF_HUB_CACHE"]) / "models--tiny-org--tiny-llama" / "blobs"
    partial = blobs / (_sha256(source) + ".jaxserve-partial")
    deadline = time.monotonic() + 120
    # Half the file was sent; the client wrote what arrived in whole 16 KiB chunks.
    while not (partial.exists() and partial.stat().st_size >= size // 2 - (1 << 14)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)             # Ctrl-C
    assert proc.wait(60) != 0, proc.stderr.read()[-3000:]
    hub.release.set()
    kept = partial.stat().st_size
    assert 0 < kept < size and not (blobs / _sha256(source)).exists()
    snapshot = Path(resolve_model("tiny-org/tiny-llama").path)
    gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith("/model.safetensors")]
    assert [g.range for g in gets] == [None, f"bytes={kept}-"]
    assert _sha256(snapshot / "model.safetensors") == _sha256(source)
    assert not partial.exists()


def test_disk_full_mid_download_leaves_nothing_taken_for_complete(hub, hub_repos, monkeypatch):
    import resource
    import signal

    def small_disk() -> None:       # writes past 300 kB fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    done = subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli", "download",
                           "tiny-org/tiny-llama"], capture_output=True, text=True,
                          env=_env(hub), cwd=ROOT, timeout=120, preexec_fn=small_disk)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "the disk filled while downloading" in done.stderr, done.stderr
    storage = Path(os.environ["HF_HUB_CACHE"]) / "models--tiny-org--tiny-llama"
    assert not (storage / "refs" / "main").exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="not in the cache"):
        resolve_model("tiny-org/tiny-llama")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    snapshot = Path(resolve_model("tiny-org/tiny-llama").path)      # room again: resumes
    source = hub_repos / "tiny-org" / "tiny-llama" / "main" / "model.safetensors"
    assert _sha256(snapshot / "model.safetensors") == _sha256(source)
    gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith("/model.safetensors")]
    assert gets[-1].range is not None


@pytest.mark.fast
def test_not_enough_disk_is_refused_before_downloading(hub, monkeypatch):
    from jaxserve.loader import hub_fetch

    monkeypatch.setattr(hub_fetch, "free_bytes", lambda directory: (1000, directory))
    with pytest.raises(HubError, match=r"needs 0\.6 MB, 0\.0 MB free in"):
        fetch_from_hub("tiny-org/tiny-llama")
    assert _downloaded(hub, "tiny-org/tiny-llama") == []


@pytest.mark.fast
def test_progress_off_a_terminal_is_a_log_line_every_tenth_and_quiet_at_warning(
        hub, monkeypatch, caplog):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)   # many updates
    caplog.set_level(logging.INFO, logger="jaxserve.loader")
    fetch_from_hub("tiny-org/tiny-llama")
    lines = [r.getMessage() for r in caplog.records if "downloading tiny-org" in r.getMessage()]
    percents = [int(line.split(": ")[1].split("%")[0]) for line in lines]
    assert percents == sorted(set(percents)) and len(percents) >= 8 and percents[-1] == 100
    assert all(" at " in line and "ETA" in line and " of 0.6 MB" in line for line in lines)
    assert any("6 files, 0.6 MB; 0.6 MB to download" in r.getMessage() for r in caplog.records)
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="jaxserve.loader")
    from jaxserve.load_progress import LOAD_PROGRESS

    seen = []
    real_report = LOAD_PROGRESS.report
    monkeypatch.setattr(LOAD_PROGRESS, "report",
                        lambda phase, progress=None: seen.append((phase, progress))
                        or real_report(phase, progress))
    fetch_from_hub("tiny-org/tiny-llama", options=HubOptions(revision="other"))
    assert not [r for r in caplog.records if r.levelno < logging.WARNING]
    # quiet in the log, still counted for a listening server's /readyz
    fractions = [f for phase, f in seen if phase == "download"]
    assert fractions[0] == 0.0 and fractions[-1] == 1.0 and fractions == sorted(fractions)
    assert LOAD_PROGRESS.state().phase == "download"


# -- one download across processes ------------------------------------------------------------
@pytest.mark.fast
def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    import socket

    path = tmp_path / "m.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    path.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                "token": "old"}))
    with DownloadLock(path, what="m"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()
    path.write_text(json.dumps({"pid": 1, "host": "another-host", "token": "old"}))
    os.utime(path, (time.time() - 600, time.time() - 600))     # no heartbeat for 10 min
    with DownloadLock(path, what="m", stale_after=60):
        assert json.loads(path.read_text())["pid"] == os.getpid()


def test_two_processes_at_once_fetch_each_file_once(hub, tmp_path):
    hub.hold.add("tiny-org/tiny-llama/model.safetensors")   # the first stays in flight
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
            "from jaxserve.loader.hub_download import fetch_from_hub; "
            "print(fetch_from_hub('tiny-org/tiny-llama'))")
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=open(log, "w"), text=True, env=_env(hub), cwd=ROOT)
             for log in logs]
    deadline = time.monotonic() + 120
    while not any("waiting for tiny-org/tiny-llama@main" in log.read_text() for log in logs):
        assert time.monotonic() < deadline, [log.read_text() for log in logs]
        assert all(p.poll() is None for p in procs), [log.read_text() for log in logs]
        time.sleep(0.1)
    hub.release.set()
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [log.read_text() for log in logs]
    assert outs[0] == outs[1] and Path(outs[0]).is_dir()
    fetched = _downloaded(hub, "tiny-org/tiny-llama")
    assert sorted(fetched) == sorted(MODEL_FILES), fetched


# -- jaxserve download, then offline -----------------------------------------------------------
def test_download_command_then_offline_load(hub, monkeypatch):
    done = subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli", "download",
                           "tiny-org/tiny-llama", "--revision", "other"], capture_output=True,
                          text=True, env=_env(hub), cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    snapshot = Path(done.stdout.strip().splitlines()[-1])
    assert snapshot.name == hub.commit("tiny-org/tiny-llama", "other")
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from jaxserve.loader import load_model

    loaded = load_model("tiny-org/tiny-llama", hub=HubOptions(revision="other"),
                        tokenizer="tiny-org/tiny-llama",
                        tokenizer_hub=HubOptions(revision="other"))
    assert loaded.model_path == str(snapshot)
    assert loaded.hf_config.intermediate_size == 96
    assert loaded.tokenizer.encode("hello") == loaded.tokenizer.encode("hello")


# -- by name, end to end (engines: not in the fast tier) --------------------------------------
# Two step buckets per engine (as tests/test_restart.py): compiling is nearly all the cost,
# and the second engine of the same shapes loads the first one's executables.
ENGINE_KWARGS = {"max_model_len": 64, "max_num_batched_tokens": 2, "max_num_seqs": 2,
                 "kv_cache_memory_bytes": 2 << 20, **precision.EXACT}
PROMPTS = [[11, 23, 98], [7] + list(range(40, 52))]


def test_llm_by_name_gives_the_tokens_of_the_same_folder_from_disk(hub, hub_repos, tmp_path):
    import gc

    from jaxserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for source in ("tiny-org/tiny-llama", str(hub_repos / "tiny-org" / "tiny-llama" / "main")):
        llm = LLM(source, compilation_cache_dir=str(tmp_path / "xla"), **ENGINE_KWARGS)
        tokens[source] = [list(o.outputs[0].token_ids)
                          for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
        gc.collect()
    by_name, from_disk = tokens.values()
    assert by_name == from_disk and all(len(t) == 6 for t in by_name)
    assert sorted(_downloaded(hub, "tiny-org/tiny-llama")) == sorted(MODEL_FILES)


def test_draft_model_by_name_is_fetched_and_drafts(hub, hub_repos, tmp_path):
    from jaxserve import LLM, SamplingParams

    # The draft is the target's weights, sharded: greedy drafts are all accepted, and the
    # tokens are the target's own.
    llm = LLM(str(hub_repos / "tiny-org" / "tiny-llama" / "main"),
              compilation_cache_dir=str(tmp_path / "xla"), max_model_len=64, max_num_seqs=1,
              max_num_batched_tokens=4, kv_cache_memory_bytes=2 << 20,
              speculative_config={"method": "draft_model", "model": "tiny-org/tiny-sharded",
                                  "num_speculative_tokens": 1},
              **precision.EXACT)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    snapshot = llm.llm_engine.snapshot()
    assert snapshot.spec_decode_num_accepted_tokens > 0
    fetched = set(_downloaded(hub, "tiny-org/tiny-sharded"))
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= fetched
    assert "consolidated.safetensors" not in fetched


def test_serve_by_name_answers_a_chat_completion(hub, tmp_path):
    import httpx

    from tests.test_server import STARTUP_TIMEOUT, free_port

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "tiny-org/tiny-llama",
             "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning",
             "--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "2",
             "--kv-cache-memory-bytes", str(2 << 20), "--dtype", "float32"],
            stdout=log, stderr=subprocess.STDOUT, env=_env(hub), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny-org/tiny-llama"]   # as typed
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-org/tiny-llama", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(60)
    assert sorted(_downloaded(hub, "tiny-org/tiny-llama")) == sorted(MODEL_FILES)
    assert "downloading tiny-org/tiny-llama@main: 100%" in log_path.read_text()


def test_convert_by_name_downloads_then_writes_the_checkpoint(hub, tmp_path):
    from jaxserve.entrypoints.convert import convert_model
    from jaxserve.loader.orbax_checkpoint import is_checkpoint

    out = convert_model("tiny-org/tiny-llama", str(tmp_path / "ckpt"), dtype="float32",
                        revision="other")
    assert is_checkpoint(Path(out))
    fetched = [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert fetched and all(hub.commit("tiny-org/tiny-llama", "other") in p for p in fetched)
    assert sorted(_downloaded(hub, "tiny-org/tiny-llama")) == sorted(MODEL_FILES)
