"""Logprobs in OpenAI's formats (legacy completions, chat) and vLLM's prompt_logprobs field.

Every entry's token text was built by the front end (`Logprob.decoded_token`); a token
without an entry is decoded here.
"""

from __future__ import annotations

from typing import Any

from jaxserve.outputs import Logprob, PromptLogprobs


def _token_text(entry: Logprob | None, token_id: int, tokenizer: Any,
                as_ids: bool = False) -> str:
    """A logprob entry's token text; "token_id:N" with as_ids (--return-tokens-as-token-ids,
    as vLLM: a token that is not valid UTF-8 alone stays identifiable)."""
    if as_ids:
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])



def legacy_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None],
                    text_offset: int, tokenizer: Any, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs of ``token_ids``; a None entry (the first prompt
    token) gives null token_logprobs and top_logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        actual = entry.get(token_id) if entry is not None else None
        text = _token_text(actual, token_id, tokenizer, as_ids)
        tokens.append(text)
        token_logprobs.append(_finite(actual.logprob) if actual else None)
        top_logprobs.append(None if entry is None else {
            _token_text(lp, tid, tokenizer, as_ids): _finite(lp.logprob)
            for tid, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def echo_logprobs(prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs | None,
                  tokenizer: Any, as_ids: bool = False) -> dict[str, Any]:
    """Echoed prompt tokens in the completions logprobs format: the first token's logprob is
    null (nothing predicts it), the rest come from the engine's prompt logprobs."""
    entries = prompt_logprobs or [None] * len(prompt_token_ids)
    return legacy_logprobs(prompt_token_ids, entries, 0, tokenizer, as_ids)


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's `prompt_logprobs` response field: [null, {token id: {logprob, rank,
    decoded_token}}, ...]."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {
        str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                   "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
        for entry in prompt_logprobs]


def _finite(logprob: float) -> float:
    """JSON has no -inf; vLLM reports -9999.0 for it."""
    return max(logprob, -9999.0)


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int,
                  tokenizer: Any, as_ids: bool = False) -> list[dict[str, Any]]:
    """Chat format: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry.get(token_id)
        text = _token_text(sampled, token_id, tokenizer, as_ids)
        ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items()
                         if lp.rank is not None and lp.rank <= num_top), key=lambda x: x[0])
        top = []
        for _, tid, lp in ranked[:num_top]:
            token_text = _token_text(lp, tid, tokenizer, as_ids)
            top.append({"token": token_text, "logprob": lp.logprob,
                        "bytes": list(token_text.encode("utf-8"))})
        content.append({"token": text, "logprob": sampled.logprob if sampled else None,
                        "bytes": list(text.encode("utf-8")), "top_logprobs": top})
    return content

