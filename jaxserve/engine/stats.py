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
    # Wall time with at least one step in flight: the union of [dispatch, collect] over
    # steps (two may overlap under async scheduling). Throughputs divide by this, so an
    # idle stretch in the window does not dilute them.
    busy_time_total: float = 0.0
    _busy_until: float = 0.0
    _last_log: float = field(default_factory=time.monotonic)
    _last_prompt: int = 0
    _last_generation: int = 0
    _last_busy: float = 0.0
    # Speculative decoding (vLLM's spec_decode counters): rows that had drafts, draft
    # tokens verified, drafts accepted, and accepted drafts per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    _last_spec: tuple[int, int, int] = (0, 0, 0)

    def enable_spec_decode(self, num_speculative_tokens: int) -> None:
        self.spec_accepted_per_pos = [0] * num_speculative_tokens

    def record_drafts(self, out, emitted_token_ids: list[list[int]]) -> None:
        """Count a step's drafts and how many of each row's were accepted."""
        for row, seq_id in enumerate(out.seq_ids):
            drafts = out.draft_token_ids.get(seq_id)
            if not drafts:
                continue
            accepted = len(emitted_token_ids[row]) - 1
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += len(drafts)
            self.spec_num_accepted_tokens += accepted
            for j in range(accepted):
                self.spec_accepted_per_pos[j] += 1

    def record_step(self, *, num_prompt_tokens: int, num_generation_tokens: int,
                    num_preempted: int, dispatch_time: float, collect_time: float) -> None:
        """Times are time.perf_counter() values of the step's dispatch and collection."""
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        self.num_preemptions += num_preempted
        self.num_steps += 1
        self.step_time_total += collect_time - dispatch_time
        self.busy_time_total += max(0.0, collect_time - max(dispatch_time, self._busy_until))
        self._busy_until = max(self._busy_until, collect_time)

    def maybe_log(self, snapshot) -> None:
        """Log the stats line every ``log_interval`` s (throughputs over busy time)."""
        now = time.monotonic()
        if now - self._last_log < self.log_interval:
            return
        busy = self.busy_time_total - self._last_busy
        prompt_tps = (self.num_prompt_tokens - self._last_prompt) / busy if busy > 0 else 0.0
        gen_tps = (self.num_generation_tokens - self._last_generation) / busy if busy > 0 \
            else 0.0
        queries = snapshot.prefix_cache_queries
        hit_rate = snapshot.prefix_cache_hits / queries if queries else 0.0
        logger.info("Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%, Avg prompt throughput: %.1f tokens/s, "
                    "Avg generation throughput: %.1f tokens/s (while busy: %.1f of the last "
                    "%.1f s), Preemptions: %d",
                    snapshot.num_running, snapshot.num_waiting, 100 * snapshot.kv_cache_usage,
                    100 * hit_rate, prompt_tps, gen_tps, busy, now - self._last_log,
                    snapshot.num_preemptions)
        if self.spec_accepted_per_pos:
            drafts, draft_tokens, accepted = (
                a - b for a, b in zip((self.spec_num_drafts, self.spec_num_draft_tokens,
                                       self.spec_num_accepted_tokens), self._last_spec))
            # vLLM's line: mean acceptance length counts the bonus/correction token too.
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d "
                        "tokens, Drafted: %d tokens, Draft acceptance rate: %.1f%%, "
                        "Drafts: %d, Per-position acceptance (since start): %s",
                        1 + accepted / drafts if drafts else 0.0, accepted, draft_tokens,
                        100 * accepted / draft_tokens if draft_tokens else 0.0, drafts,
                        ", ".join(f"{n / self.spec_num_drafts:.3f}" if self.spec_num_drafts
                                  else "0" for n in self.spec_accepted_per_pos))
            self._last_spec = (self.spec_num_drafts, self.spec_num_draft_tokens,
                               self.spec_num_accepted_tokens)
        self._last_log = now
        self._last_prompt = self.num_prompt_tokens
        self._last_generation = self.num_generation_tokens
        self._last_busy = self.busy_time_total
