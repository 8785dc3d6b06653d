"""Engine counters and the periodic stats log line (the server exports them to Prometheus)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("jaxserve.stats")


@dataclass
class EngineStats:
    log_interval: float = 10.0
    num_prompt_tokens: int = 0          # totals since start
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    step_time_total: float = 0.0
    _last_log: float = field(default_factory=time.monotonic)
    _last_prompt: int = 0
    _last_generation: int = 0

    def record_step(self, *, num_prompt_tokens: int, num_generation_tokens: int,
                    num_preempted: int, step_time: float) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        self.num_preemptions += num_preempted
        self.num_steps += 1
        self.step_time_total += step_time

    def maybe_log(self, snapshot) -> None:
        """Log the stats line every ``log_interval`` s."""
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.log_interval:
            return
        prompt_tps = (self.num_prompt_tokens - self._last_prompt) / elapsed
        gen_tps = (self.num_generation_tokens - self._last_generation) / elapsed
        queries = snapshot.prefix_cache_queries
        hit_rate = snapshot.prefix_cache_hits / queries if queries else 0.0
        logger.info("Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%, Avg prompt throughput: %.1f tokens/s, "
                    "Avg generation throughput: %.1f tokens/s, Preemptions: %d",
                    snapshot.num_running, snapshot.num_waiting, 100 * snapshot.kv_cache_usage,
                    100 * hit_rate, prompt_tps, gen_tps, snapshot.num_preemptions)
        self._last_log = now
        self._last_prompt = self.num_prompt_tokens
        self._last_generation = self.num_generation_tokens
