"""`LLM`: offline batch generation, vLLM's user surface.

    from jaxserve import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from typing import Any
from typing import Sequence as Seq

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.parallel.launch import create_engine_core
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        if "config" in engine_kwargs:
            config = engine_kwargs.pop("config")
            if engine_kwargs:
                raise TypeError("pass either config= or engine kwargs, not both")
        else:
            config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        # The front end on this thread, over an EngineCore, the data-parallel core or a
        # multi-host leader's core (jaxserve/parallel).
        self.llm_engine = LLMEngine(create_engine_core(config))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # -- generate ------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        A prompt is a string, a list of token ids, or {"prompt": str} /
        {"prompt_token_ids": [...]}; a single prompt may be passed bare.
        lora_request: one LoRARequest for every prompt, or one (or None: the base model) per
        prompt; needs LLM(..., enable_lora=True).
        """
        prompts = _as_prompt_list(prompts)
        params = _broadcast_params(sampling_params, len(prompts))
        loras = _broadcast_lora(lora_request, len(prompts))
        engine = self.llm_engine
        ids = []
        staged = [_split_prompt(p) for p in prompts]
        try:   # a prompt that can never run fails the call, and nothing stays queued
            for (text, token_ids), sp, lora in zip(staged, params, loras):
                if sp.output_kind != RequestOutputKind.FINAL_ONLY:   # only the final is read
                    sp = sp.clone()
                    sp.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._counter))
                engine.add_request(request_id, text, sp, prompt_token_ids=token_ids,
                                   **({"lora_request": lora} if lora is not None else {}))
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req")
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in request_ids]

    # -- chat ----------------------------------------------------------------------------------
    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        from jaxserve.loader.tokenizer import apply_chat_template

        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template = chat_template or self.llm_engine.config.model_config.chat_template
        prompts = [{"prompt_token_ids": apply_chat_template(
            self.llm_engine.tokenizer, conv, chat_template=template,
            add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]                      # one prompt given as token ids
    return prompts


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        return prompt.get("prompt"), prompt.get("prompt_token_ids")
    return None, [int(t) for t in prompt]


def _broadcast_lora(lora: Any, count: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    lora = list(lora)
    if len(lora) != count:
        raise ValueError(f"got {len(lora)} lora_requests for {count} prompts")
    return lora


def _broadcast_params(params: Any, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
