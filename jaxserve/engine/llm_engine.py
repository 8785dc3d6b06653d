"""The engine loop: add requests, step (schedule → run → update), return outputs.

One `step()` is the whole serving loop on a screen:
    out = scheduler.schedule()
    result = runner.execute(out.scheduled)
    done = scheduler.complete_step(out)        # KV now holds the scheduled tokens
    append sampled tokens to `done`, detokenize, stop checks, free finished seqs
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.stats import EngineStats
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Offline/online engine core. Not thread-safe: one thread calls add/abort/step."""

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None,
                 mesh: Any = None) -> None:
        """mesh: this replica's (1, tp) sub-mesh under data parallelism (jaxserve/parallel)."""
        from jaxserve.engine.model_setup import setup_model

        self.config = config
        self.setup = setup_model(config, mesh)       # loads weights, sizes the cache, warms up
        s = self.setup
        self.tokenizer = s.tokenizer
        self.max_model_len = s.max_model_len
        self.block_manager = BlockManager(s.kv_plan.num_blocks, s.kv_plan.block_size,
                                          config.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager, s.max_model_len)
        self.runner = s.runner
        self.outputs = OutputProcessor(self.tokenizer, s.eos_token_ids, s.max_model_len,
                                       config.model_config.max_logprobs,
                                       s.default_sampling_overrides, seed=config.model_config.seed)
        self.stats = EngineStats()
        if log_stats is None:
            log_stats = not config.runner_config.disable_log_stats
        self.log_stats = log_stats

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    sampling_params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError (and changes nothing) if it can never run."""
        self.runner.sampling.check(sampling_params or SamplingParams())
        seqs = self.outputs.new_request(request_id, prompt, prompt_token_ids,
                                        sampling_params or SamplingParams(),
                                        arrival_time or time.time())
        for seq in seqs:
            self.scheduler.add_seq(seq)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            for seq in self.scheduler.abort_request(request_id):
                self.runner.release(seq.seq_id)
            self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.outputs.has_pending_outputs()

    def get_num_unfinished_requests(self) -> int:
        return self.outputs.num_unfinished

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return outputs of requests that changed (or finished)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return self.outputs.drain()
        step_start = time.perf_counter()
        scheduled_time = time.time()
        scheduled = [(item.seq, item.num_new_tokens) for item in out.scheduled]
        result = self.runner.execute(scheduled)
        now = time.time()
        completed = {seq.seq_id for seq in self.scheduler.complete_step(out)}
        num_generated = 0
        for row, (seq, _) in enumerate(scheduled):
            self.outputs.mark_scheduled(seq, scheduled_time)
            if seq.seq_id not in completed:
                continue                      # mid-prefill chunk: its sample is meaningless
            status = self.outputs.append_token(seq, result, row, now)
            num_generated += 1
            if status is not None:
                self.scheduler.finish_seq(seq, status)
                self.runner.release(seq.seq_id)
        self.stats.record_step(
            num_prompt_tokens=out.num_batched_tokens - num_generated_decodes(scheduled),
            num_generation_tokens=num_generated, num_preempted=len(out.preempted),
            step_time=time.perf_counter() - step_start)
        if self.log_stats:
            self.stats.maybe_log(self.scheduler, self.block_manager)
        return self.outputs.drain()

    # -- inspection ----------------------------------------------------------------------------
    def prompt_logits(self, prompt_token_ids: list[int]) -> "np.ndarray":
        """Logits [len, V] of a prompt through the paged path, for parity checks (idle engine)."""
        from jaxserve.engine.sequence import Sequence

        seq = Sequence("__prompt_logits__", prompt_token_ids, SamplingParams())
        if not self.block_manager.allocate_slots(seq, seq.num_tokens):
            raise RuntimeError("not enough free KV blocks for prompt_logits")
        try:
            return self.runner.prompt_logits(seq)
        finally:
            self.block_manager.free(seq)


def num_generated_decodes(scheduled: list) -> int:
    """Decode tokens in a step: sequences past their prompt that feed back one sampled token."""
    return sum(1 for seq, n in scheduled if seq.num_computed_tokens - n >= seq.num_prompt_tokens)
