"""Expert parallelism: psum combine (what models/moe.py does) against an all_to_all dispatch.

Both run one MoE block over `--devices` devices of the `model` axis, E/ep whole experts per
device, from the same replicated tokens (between our layers every device holds all T
tokens: attention is tensor parallel):

* psum:       every device runs the pairs routed to its experts and the partial [T, H]
              outputs are summed with one all-reduce.
* all_to_all: each device takes T/ep of the tokens, sends every (token, choice) pair to its
              expert's device (fixed-capacity buffers: a step's shapes are static, so each
              destination gets room for all T/ep*k pairs), the results come back with a
              second all_to_all, are weighted and summed locally, and an all-gather rebuilds
              the replicated [T, H] the next layer's attention needs.
* tp:         every expert's intermediate dimension split, one all-reduce (the default).

Reports, per variant, the median time of the jitted block and the bytes each device's
collectives carry in the compiled HLO (operand sizes), and checks all three agree.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python benchmarks/bench_moe_dispatch.py --devices 4 --tokens 64,512
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.mesh import MODEL_AXIS, make_mesh
from jaxserve.models import moe

_COLLECTIVE = re.compile(r"= (.+?) (all-reduce|all-gather|all-to-all|reduce-scatter|"
                         r"collective-permute)(?:-start)?\(")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def all_to_all_experts(mesh, num_tokens: int, top_k: int, activation: str = "silu"):
    ep = mesh.shape[MODEL_AXIS]
    local_tokens = num_tokens // ep
    capacity = local_tokens * top_k                 # worst case: every pair to one device

    def per_device(x, weights, experts, w_gate, w_up, w_down):
        me, num_here = jax.lax.axis_index(MODEL_AXIS), w_gate.shape[0]
        start = me * local_tokens
        x = jax.lax.dynamic_slice_in_dim(x, start, local_tokens)
        weights = jax.lax.dynamic_slice_in_dim(weights, start, local_tokens).reshape(-1)
        experts = jax.lax.dynamic_slice_in_dim(experts, start, local_tokens).reshape(-1)
        dest = experts // num_here                                         # [pairs]
        onehot = dest[:, None] == jnp.arange(ep)[None, :]
        slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
        token = jnp.arange(experts.shape[0]) // top_k
        send_x = jnp.zeros((ep, capacity, x.shape[1]), x.dtype).at[dest, slot].set(x[token])
        send_e = jnp.full((ep, capacity), -1, jnp.int32).at[dest, slot].set(experts)
        recv_x = jax.lax.all_to_all(send_x, MODEL_AXIS, 0, 0)
        recv_e = jax.lax.all_to_all(send_e, MODEL_AXIS, 0, 0)
        rows = recv_x.reshape(ep * capacity, -1)
        ids = recv_e.reshape(ep * capacity, 1)
        out = moe.grouped_experts(rows, jnp.ones(ids.shape, jnp.float32), ids, w_gate, w_up,
                                  w_down, me * num_here, activation)     # empty slots: 0
        back = jax.lax.all_to_all(out.reshape(ep, capacity, -1), MODEL_AXIS, 0, 0)
        pairs = back[dest, slot].astype(jnp.float32) * weights[:, None]
        mine = jnp.zeros((local_tokens, x.shape[1]), jnp.float32).at[token].add(pairs)
        return jax.lax.all_gather(mine.astype(x.dtype), MODEL_AXIS, tiled=True)

    spec = P(MODEL_AXIS, None, None)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), spec, spec, spec),
                         out_specs=P(), check_vma=False)


def collective_bytes(compiled_text: str) -> dict[str, int]:
    totals: dict[str, int] = {}
    for result, op in _COLLECTIVE.findall(compiled_text):     # result: one shape or a tuple
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            size = int(np.prod([int(d) for d in dims.split(",") if d])) * _BYTES.get(dtype, 4)
            totals[op] = totals.get(op, 0) + size
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tokens", default="64,512")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    mesh = make_mesh(args.devices, 1)
    rng = np.random.default_rng(0)
    E, H, I = args.experts, args.hidden, args.intermediate
    w_gate, w_up = (rng.standard_normal((E, H, I), np.float32) * H ** -0.5 for _ in range(2))
    w_down = rng.standard_normal((E, I, H), np.float32) * I ** -0.5
    ep_spec, rows = NamedSharding(mesh, P(MODEL_AXIS)), []
    tp_specs = [NamedSharding(mesh, s) for s in
                moe.ExpertSharding(mesh, expert_parallel=False).weight_specs()]
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = rng.standard_normal((num_tokens, H), np.float32)
        weights, experts = moe.route(jnp.asarray(rng.standard_normal((num_tokens, E))),
                                     args.top_k, True)
        inputs = (jnp.asarray(x), weights, experts)
        variants = {
            "psum": (moe.sharded_experts(moe.ExpertSharding(mesh, True), "silu"), [ep_spec] * 3),
            "all_to_all": (all_to_all_experts(mesh, num_tokens, args.top_k), [ep_spec] * 3),
            "tp": (moe.sharded_experts(moe.ExpertSharding(mesh, False), "silu"), tp_specs),
        }
        outputs = {}
        for name, (fn, specs) in variants.items():
            placed = [jax.device_put(w, s) for w, s in zip((w_gate, w_up, w_down), specs)]
            compiled = jax.jit(fn).lower(*inputs, *placed).compile()
            outputs[name] = np.asarray(compiled(*inputs, *placed))
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                compiled(*inputs, *placed).block_until_ready()
                times.append(time.perf_counter() - start)
            row = {"tokens": num_tokens, "variant": name,
                   "ms": round(statistics.median(times) * 1e3, 3),
                   "collective_bytes": collective_bytes(compiled.as_text())}
            rows.append(row)
            print(json.dumps(row))
        for name in ("all_to_all", "tp"):
            np.testing.assert_allclose(outputs[name], outputs["psum"], rtol=1e-4, atol=1e-4)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": jax.devices()[0].platform, "devices": args.devices,
                       "shapes": {"experts": E, "hidden": H, "intermediate": I,
                                  "top_k": args.top_k}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
