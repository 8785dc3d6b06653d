"""Multi-host: one engine spans several JAX processes joined by `jax.distributed`.

Process 0 (the leader) does everything a single-process server does: HTTP,
scheduling, input assembly, detokenization. Every process holds its shards of
the weights and KV cache and executes the same compiled step on its own
devices; XLA's collectives (NCCL on GPU, gloo over TCP on CPU) join them. The
followers learn each step's inputs from the leader through a JAX collective
(`multihost_utils.broadcast_one_to_all`), never through an RPC of our own:

    leader, per step                          follower, forever
    ─────────────────                         ─────────────────
    pack the step's StepInputs                header = broadcast(zeros)     # [cmd, T, S, ...]
    broadcast(header)             ───────▶    payload = broadcast(zeros of the bucket's shapes)
    broadcast(payload)            ───────▶    runner.run_step(payload)      # same program
    runner.run_step(...)                      (STOP → leave the loop, exit 0)

Every process runs the same executables on the same inputs, so the device-resident
state a step carries (the KV cache, the last sampled token of each row, the penalty
history, loaded from the admissions a step's inputs carry) evolves the
same way everywhere, and async scheduling needs nothing extra here. With pipeline
parallelism (`-pp`) each process runs only its own stages of the step and the stages'
hand-offs are collectives too (runner/pipeline_processes.py), joined by every process in
the order the broadcast steps give.

At exit the leader broadcasts STOP, so followers leave cleanly (exit 0). If
the leader dies instead, the followers' pending collective fails (the TCP peer
is gone) and they exit with status 1 within seconds. An idle leader simply
leaves the followers waiting inside the broadcast (checked for 400 s on CPU
gloo; NCCL has no timeout by default).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from typing import Any

import jax
import numpy as np

from jaxserve.config import ParallelConfig
from jaxserve.runner.input_batch import StepInputs

logger = logging.getLogger(__name__)

STEP, STOP = 1, 2
_HEADER = 8   # int32 [command, T, S, penalty history chunks, has_bias, has_grammar, 0, 0]


def initialize(parallel: ParallelConfig) -> bool:
    """`jax.distributed.initialize` from the config, once, before JAX touches a device.

    Returns True in a multi-process run. On CPU the processes exchange collectives
    over TCP with gloo (`jax_cpu_collectives_implementation`, JAX's default).
    """
    if parallel.num_processes <= 1:
        return False
    if jax.distributed.is_initialized():
        return True
    if not parallel.coordinator_address or ":" not in parallel.coordinator_address:
        raise ValueError(f"num_processes={parallel.num_processes} needs --coordinator-address "
                         f"HOST:PORT (process 0's address), got "
                         f"{parallel.coordinator_address!r}")
    if not 0 <= parallel.process_id < parallel.num_processes:
        raise ValueError(f"process_id must be in [0, {parallel.num_processes - 1}], got "
                         f"{parallel.process_id}")
    if parallel.data_parallel_size > 1:
        raise ValueError("multi-process runs shard one engine over every device "
                         "(tensor_parallel_size = all devices); data_parallel_size > 1 "
                         "across processes is not supported: run one server per replica")
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("process %d of %d joining the coordinator at %s", parallel.process_id,
                parallel.num_processes, parallel.coordinator_address)
    jax.distributed.initialize(coordinator_address=parallel.coordinator_address,
                               num_processes=parallel.num_processes,
                               process_id=parallel.process_id)
    logger.info("jax.distributed: %d processes, %d devices (%d here)", jax.process_count(),
                jax.device_count(), jax.local_device_count())
    return True


def is_leader() -> bool:
    return jax.process_index() == 0


def _broadcast(tree: Any) -> Any:
    from jax.experimental.multihost_utils import broadcast_one_to_all

    return broadcast_one_to_all(tree)


class StepBroadcaster:
    """The leader's half: sends every step's inputs to the followers, and STOP at exit.

    Installed as `ModelRunner.step_channel`; the runner calls `send` just before it
    runs a step, on the one thread that steps the engine.
    """

    def __init__(self) -> None:
        self._stopped = False
        atexit.register(self.stop)   # runs before JAX's own atexit shutdown (LIFO)

    def send(self, inputs: StepInputs) -> None:
        if self._stopped:
            raise RuntimeError("the followers were already told to stop")
        admissions = inputs.penalty_admissions
        penalties = 0 if admissions is None else len(admissions.chunks)
        bias = inputs.bias_token_ids is not None
        grammar = inputs.grammar_bitmask is not None
        header = np.zeros(_HEADER, np.int32)
        header[:6] = (STEP, inputs.num_tokens, inputs.num_seqs, penalties, bias, grammar)
        _broadcast(header)
        _broadcast(_payload(inputs))

    def stop(self) -> None:
        """Tell the followers to leave their loop (idempotent; called at exit)."""
        if self._stopped:
            return
        self._stopped = True
        header = np.zeros(_HEADER, np.int32)
        header[0] = STOP
        try:
            _broadcast(header)
            logger.info("told the followers to stop")
        except Exception:
            logger.warning("could not tell the followers to stop", exc_info=True)


def lead(runner: Any) -> StepBroadcaster:
    """Make `runner` (process 0's) broadcast each step's inputs before running it."""
    channel = StepBroadcaster()
    runner.step_channel = channel
    return channel


def _payload(inputs: StepInputs) -> dict[str, np.ndarray]:
    """The arrays of a step that travel (the optional tables only when present)."""
    payload = {"packed": inputs.packed}
    if inputs.penalty_admissions is not None:
        payload["penalty_resets"] = inputs.penalty_admissions.resets
        payload["penalty_chunks"] = inputs.penalty_admissions.chunks
    if inputs.bias_token_ids is not None:
        payload["bias_token_ids"] = inputs.bias_token_ids
        payload["bias_values"] = inputs.bias_values
    if inputs.grammar_bitmask is not None:
        payload["grammar_bitmask"] = inputs.grammar_bitmask
    return payload


def follow(runner: Any) -> int:
    """A follower's whole life: run each step the leader broadcasts until STOP.

    Returns 0 after STOP. If the leader vanishes (its collective fails), the process
    exits at once with status 1: JAX's own shutdown would wait on a coordinator that
    is gone.
    """
    logger.info("process %d: following the leader's steps", jax.process_index())
    num_steps = 0
    try:
        while True:
            header = _broadcast(np.zeros(_HEADER, np.int32))
            command, t, s, penalties, bias, grammar = (int(v) for v in header[:6])
            if command == STOP:
                logger.info("process %d: the leader stopped after %d steps", jax.process_index(),
                            num_steps)
                return 0
            if command != STEP:
                raise RuntimeError(f"unknown command {command} from the leader")
            template = runner.empty_inputs(t, s, penalty_chunks=penalties, bias=bool(bias),
                                           grammar=bool(grammar))
            payload = _broadcast(_payload(template))
            if penalties:
                payload["penalty_admissions"] = dataclasses.replace(
                    template.penalty_admissions, resets=payload.pop("penalty_resets"),
                    chunks=payload.pop("penalty_chunks"))
            runner.run_step(dataclasses.replace(template, **payload))
            num_steps += 1
    except Exception:
        logger.exception("process %d: lost the leader after %d steps; exiting",
                         jax.process_index(), num_steps)
        logging.shutdown()
        os._exit(1)


def run_follower(config: Any) -> None:
    """Load this process's shards, compile, follow the leader; then end the process (exit 0).

    Raises SystemExit: a follower has nothing to return to (no HTTP, no generate).
    """
    from jaxserve.engine.model_setup import setup_model

    setup = setup_model(config)
    raise SystemExit(follow(setup.runner))
