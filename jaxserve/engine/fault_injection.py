"""Step faults on purpose, for tests and the soak benchmark only (never in production).

An engine calls its `fault_hook` inside `step()`; an exception raised there is a step fault
like a device error, and goes through the same recovery (jaxserve/engine/async_engine.py).
Tests set the hook directly; `jaxserve serve --fault-injection-every-steps N` installs a
`StepFaultInjector` for a whole server (benchmarks/soak.py), since a benchmark cannot reach
into the server process and an environment knob would be a hidden product behaviour.
"""

from __future__ import annotations


class InjectedStepFault(RuntimeError):
    """Raised by a fault hook: a fault injected on purpose."""


class StepFaultInjector:
    """A fault hook that raises on every `every_steps`-th call."""

    def __init__(self, every_steps: int) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.every_steps = every_steps
        self.calls = 0
        self.num_faults = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % self.every_steps == 0:
            self.num_faults += 1
            raise InjectedStepFault(f"injected step fault #{self.num_faults} "
                                    f"(every {self.every_steps} steps)")
