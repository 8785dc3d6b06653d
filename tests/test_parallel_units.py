"""Partition specs, KV-head replication, tp validation and the DP front's routing (one device)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.mesh import make_mesh
from jaxserve.models import partition
from jaxserve.models.arch import ModelArch
from jaxserve.models.llama import FAMILY as LLAMA
from jaxserve.parallel.data_parallel import DataParallelEngineCore

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`


def _arch(**overrides) -> ModelArch:
    base = {"architecture": "LlamaForCausalLM", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
            "head_dim": 16, "max_position_embeddings": 128, "tie_word_embeddings": False}
    return ModelArch(**{**base, **overrides})


def test_invalid_tp_size_error_names_the_valid_sizes():
    smollm2 = _arch(num_heads=9, num_kv_heads=3, hidden_size=576, head_dim=64,
                    intermediate_size=1536)
    assert partition.valid_tp_sizes(smollm2) == [1, 3]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* valid sizes: 1, 3$"):
        partition.check_tp_size(smollm2, 2)
    assert partition.valid_tp_sizes(_arch()) == [1, 2, 4]


def test_kv_head_replication_puts_each_query_heads_kv_head_on_its_device():
    arch, tp = _arch(), 4                         # 4 query heads, 2 KV heads, 4 devices
    layers, hidden, d = arch.num_layers, arch.hidden_size, arch.head_dim
    rng = np.random.default_rng(0)
    k = rng.standard_normal((layers, hidden, arch.num_kv_heads * d)).astype(np.float32)
    bias = rng.standard_normal((layers, arch.num_kv_heads * d)).astype(np.float32)
    weights = partition.replicate_kv_heads(
        {"layers.k_proj.kernel": k.copy(), "layers.k_proj.bias": bias.copy()}, arch, tp,
        LLAMA.kv_head_weights)
    sharded = partition.arch_for_tp(arch, tp)
    assert sharded.num_kv_heads == 4 and sharded.num_heads == 4
    k4 = weights["layers.k_proj.kernel"].reshape(layers, hidden, 4, d)
    b4 = weights["layers.k_proj.bias"].reshape(layers, 4, d)
    group = arch.num_heads // arch.num_kv_heads
    for q_head in range(arch.num_heads):
        device = q_head // (arch.num_heads // tp)           # query heads split evenly
        original = q_head // group                         # the KV head it reads at tp=1
        np.testing.assert_array_equal(k4[:, :, device], k.reshape(layers, hidden, 2, d)[
            :, :, original])
        np.testing.assert_array_equal(b4[:, device], bias.reshape(layers, 2, d)[:, original])


def test_partition_specs_are_megatron_style():
    def spec(*path, shape=(2, 64, 64)):
        return LLAMA.param_spec(path, shape, 2)

    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert spec("layers", name, "kernel") == P(None, None, "model")
    assert spec("layers", "q_proj", "bias", shape=(2, 64)) == P(None, "model")
    for name in ("o_proj", "down_proj"):
        assert spec("layers", name, "kernel") == P(None, "model", None)
    assert spec("layers", "o_proj", "bias", shape=(2, 64)) == P()
    assert spec("layers", "input_layernorm", "weight", shape=(2, 64)) == P()
    assert spec("norm", "weight", shape=(64,)) == P()
    assert spec("embed_tokens", "embedding", shape=(512, 64)) == P("model", None)
    assert spec("lm_head", "kernel", shape=(64, 512)) == P(None, "model")
    # A vocabulary that does not divide: split the hidden axis instead.
    assert spec("embed_tokens", "embedding", shape=(511, 64)) == P(None, "model")
    assert spec("lm_head", "kernel", shape=(64, 511)) == P("model", None)
    with pytest.raises(ValueError, match="no partition spec"):
        spec("layers", "mystery", "kernel")


def test_mesh_needing_more_devices_than_visible_says_how_to_simulate_them():
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=8"):
        make_mesh(4, 2)


@dataclasses.dataclass
class _FakeReplica:
    unfinished: int
    usage: float
    added: list = dataclasses.field(default_factory=list)

    def get_num_unfinished_requests(self):
        return self.unfinished

    @property
    def block_manager(self):
        return self

    def add_request(self, request):
        self.added.append(request.request_id)
        self.unfinished += 1


def _request(request_id):
    from jaxserve.engine.engine_io import EngineRequest
    from jaxserve.sampling_params import SamplingParams

    return EngineRequest(request_id, None, [1, 2], SamplingParams(), 0.0)


def test_requests_go_to_the_least_loaded_replica():
    front = DataParallelEngineCore.__new__(DataParallelEngineCore)
    front.replicas = [_FakeReplica(2, 0.1), _FakeReplica(1, 0.9), _FakeReplica(1, 0.2)]
    front.num_routed, front._owner = [0, 0, 0], {}
    for request_id in "abcd":
        front.add_request(_request(request_id))
    # fewest unfinished first, then the emptiest KV cache, then the lowest index
    assert [r.added for r in front.replicas] == [["c"], ["b"], ["a", "d"]]
    assert front.num_routed == [1, 1, 2]
    with pytest.raises(ValueError, match="already in use"):
        front.add_request(_request("a"))


def test_snapshot_sums_the_replicas():
    front = DataParallelEngineCore.__new__(DataParallelEngineCore)
    front.replicas = [
        SimpleNamespace(snapshot=lambda: EngineSnapshot(
            num_running=1, kv_cache_usage=0.5, num_blocks=100, num_steps=3,
            spec_decode_accepted_per_pos=(2, 1), running_lora_adapters=("b", "c"))),
        SimpleNamespace(snapshot=lambda: EngineSnapshot(
            num_running=3, kv_cache_usage=0.0, num_blocks=300, num_steps=4,
            spec_decode_accepted_per_pos=(5, 0), running_lora_adapters=("a", "b"))),
        SimpleNamespace(snapshot=lambda: EngineSnapshot())]    # a replica that never ran
    snap = front.snapshot()
    assert snap.num_running == 4 and snap.num_blocks == 400 and snap.num_steps == 7
    assert snap.kv_cache_usage == pytest.approx(50 / 400)
    assert snap.spec_decode_accepted_per_pos == (7, 1)        # position by position
    assert snap.running_lora_adapters == ("a", "b", "c")      # a sorted union
    assert snap.waiting_lora_adapters == ()
