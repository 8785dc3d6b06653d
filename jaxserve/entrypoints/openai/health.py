"""What each probe asks, answered from the engine's state: GET /health, /livez, /readyz.

    /health   vLLM's: 200 while the engine serves; 503 (OpenAI's error shape) while it
              loads, restarts after a failed step, drains, is dead, or one iteration has
              run past --step-stall-timeout. Clients written for vLLM keep working.
    /livez    liveness: is the engine loop advancing? 200 while loading, idle, busy,
              recovering or draining; 503 once the engine is dead (and not recovering),
              its thread is gone, loading failed, or one iteration has run past
              --liveness-stall-timeout (the loop is stuck: only a restart helps).
    /readyz   readiness: can this replica take a request and produce a token now?
              200 once weights are loaded and warm-up's buckets compiled, while not
              draining, not recovering, not stalled and admission control has room;
              503 with the reason otherwise. While loading:
              `{"status": "loading", "phase": "compile", "progress": 0.43}`.

Saturation: a replica whose admission control is full answers every new request with 503
at once, so sending it traffic only costs the client a retry: /readyz says "saturated"
and the load balancer stops routing there until a sequence finishes. A long queue that
still has room is *not* unready: its requests will produce tokens, and unreadying busy
replicas would shrink the fleet exactly when it is loaded (the HPA on
jaxserve:num_requests_waiting adds replicas instead). Orchestrators remove an endpoint
only after several failed probes (failureThreshold), so a brief full queue does not flap.
"""

from __future__ import annotations

import time
from typing import Any

from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.load_progress import LoadState

# A request the engine hasn't stepped for this long while it has work means a stalled loop.
HEALTH_STALL_SECONDS = 600.0

Probe = tuple[int, dict[str, Any]]     # (HTTP status, JSON body)


def health_problem(engine: AsyncLLMEngine, step_stall_timeout: float) -> str | None:
    """Why /health is 503 for a loaded engine (None: healthy)."""
    problem = engine.health_problem
    if problem is None and engine.snapshot.num_running > 0 and \
            time.monotonic() - engine.last_step_time > HEALTH_STALL_SECONDS:
        problem = "engine stalled"
    busy_for = engine.watchdog.busy_for()
    if problem is None and busy_for > step_stall_timeout:
        problem = (f"the engine step has been running for {busy_for:.1f} s "
                   f"(--step-stall-timeout {step_stall_timeout:g} s)")
    return problem


def liveness(engine: AsyncLLMEngine, liveness_stall_timeout: float) -> Probe:
    """/livez for a loaded engine: the loop is alive and no iteration is stuck."""
    if not engine.loop_running:
        dead = engine.dead_error
        reason = f"the engine is dead: {dead!r}" if dead else "the engine thread has stopped"
        return 503, {"status": "dead", "reason": reason}
    busy_for = engine.watchdog.busy_for()
    if busy_for > liveness_stall_timeout:
        return 503, {"status": "stuck", "reason": (
            f"one engine iteration has been running for {busy_for:.1f} s "
            f"(--liveness-stall-timeout {liveness_stall_timeout:g} s)")}
    return 200, {"status": "alive", "iteration_seconds": round(busy_for, 3)}


def readiness(engine: AsyncLLMEngine, step_stall_timeout: float) -> Probe:
    """/readyz for a loaded engine: it can take a request and produce a token now."""
    if not engine.loop_running:
        return 503, {"status": "dead", "reason": engine.health_problem}
    if not engine.accepting:
        return 503, {"status": "draining", "reason": "the server is shutting down"}
    recovering = engine.recovery_reason
    if recovering is not None:
        return 503, {"status": "recovering", "reason": recovering}
    busy_for = engine.watchdog.busy_for()
    if busy_for > step_stall_timeout:
        return 503, {"status": "stalled", "reason": (
            f"the engine step has been running for {busy_for:.1f} s "
            f"(--step-stall-timeout {step_stall_timeout:g} s)")}
    if not engine.has_room(1):
        return 503, {"status": "saturated", "reason": (
            f"admission control is full ({engine.num_unfinished_seqs} sequences in flight "
            f"or queued; the limit is {engine.max_unfinished_seqs})")}
    return 200, {"status": "ready"}


def loading_readiness(state: LoadState) -> Probe:
    """/readyz while the model loads: which phase, and how far."""
    return 503, {"status": "loading", "phase": state.phase, "progress": state.progress}


def loading_liveness(failure: BaseException | None) -> Probe:
    """/livez while the model loads: alive unless loading failed."""
    if failure is not None:
        return 503, {"status": "dead", "reason": f"loading the model failed: {failure!r}"}
    return 200, {"status": "alive", "loading": True}
