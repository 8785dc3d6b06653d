"""The front end's RequestText: token deltas in any chunking give the text a full decode
gives, cut where the reference stop-string search cuts it, in every output kind."""

from __future__ import annotations

import random

import pytest

from jaxserve.detokenizer import find_stop_string
from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest, SeqDelta
from jaxserve.engine.request_text import RequestText, SeqText, TokenTexts
from jaxserve.outputs import RequestMetrics
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

try:
    from tests.fake_engine import ByteTokenizer
except ImportError:  # run from tests/
    from fake_engine import ByteTokenizer


pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`


def reference(tokens: list[int], stops: list[str], include: bool, min_tokens: int):
    """(text, token count, stop string) the old one-token-at-a-time engine loop gave."""
    text = ""
    for k in range(len(tokens)):
        new_text = bytes(tokens[:k + 1]).decode()
        new = len(new_text) - len(text)
        text = new_text
        if k + 1 > min_tokens:
            match = find_stop_string(text, new, stops, include)
            if match is not None:
                return match[1], k + 1, match[0]
    return text, len(tokens), None


def drive(tokens, stops, include, kind, rng, min_tokens=0):
    params = SamplingParams(max_tokens=len(tokens), stop=stops, min_tokens=min_tokens,
                            include_stop_str_in_output=include, output_kind=kind, logprobs=1)
    tokenizer = ByteTokenizer()
    request = RequestText(EngineRequest("r", None, [1, 2], params, 0.0), tokenizer,
                          TokenTexts(tokenizer))
    outputs, stopped_at, sent = [], None, 0
    while sent < len(tokens) and not request.finished:
        chunk = tokens[sent:sent + rng.randint(1, 3)]
        sent += len(chunk)
        reason = "length" if sent == len(tokens) else None
        logprobs = [(t, -1.0, 1, [t], [-1.0]) for t in chunk]
        to_stop = request.apply(EngineCoreOutput(
            "r", [SeqDelta(0, chunk, logprobs, reason)], reason is not None, 0,
            RequestMetrics(0.0)))
        if to_stop:
            stopped_at = sent
        output = request.make_output()
        if output is not None:
            outputs.append(output)
    return outputs, stopped_at, sent


@pytest.mark.parametrize("include", [False, True])
def test_every_output_kind_gives_the_reference_text_in_any_chunking(include):
    rng = random.Random(5)
    num_stopped = 0
    for trial in range(300):
        tokens = [rng.choice(b"abc d") for _ in range(rng.randrange(1, 40))]
        text = bytes(tokens).decode()
        stops = [text[i:i + rng.randrange(1, 5)] for i in
                 (rng.randrange(len(text)) for _ in range(rng.randrange(0, 3)))]
        stops += ["zz"] if trial % 2 else []
        min_tokens = min(len(tokens), rng.choice([0, 0, 3]))
        want_text, want_tokens, want_stop = reference(tokens, stops, include, min_tokens)
        num_stopped += want_stop is not None
        results = {}
        for kind in RequestOutputKind:
            outputs, stopped_at, num_sent = drive(
                tokens, stops, include, kind, random.Random(trial), min_tokens)
            assert outputs and outputs[-1].finished
            results[kind] = outputs
            # a stop in a delta before the engine's own last one: the engine is told to stop
            assert (stopped_at is not None) == (want_stop is not None
                                                and num_sent < len(tokens))
        [final] = results[RequestOutputKind.FINAL_ONLY]
        completion = final.outputs[0]
        assert completion.text == want_text, (tokens, stops)
        assert completion.token_ids == tokens[:want_tokens]
        assert len(completion.logprobs) == want_tokens
        assert completion.stop_reason == want_stop
        assert completion.finish_reason == ("stop" if want_stop else "length")
        deltas = [c for out in results[RequestOutputKind.DELTA] for c in out.outputs]
        assert "".join(c.text for c in deltas) == want_text
        assert [t for c in deltas for t in c.token_ids] == tokens[:want_tokens]
        cumulative = [out.outputs[0] for out in results[RequestOutputKind.CUMULATIVE]]
        assert cumulative[-1].text == want_text
        assert all(b.text.startswith(a.text) for a, b in zip(cumulative, cumulative[1:]))
    assert num_stopped > 100


def test_text_pieces_slice_and_truncate_like_a_string():
    rng = random.Random(1)
    for _ in range(200):
        seq, text = SeqText(0, None, False), ""
        for _ in range(rng.randrange(0, 8)):
            piece = "".join(rng.choice("xyz") for _ in range(rng.randrange(1, 5)))
            seq.append(piece)
            text += piece
        a, b = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        assert seq.slice(a, b) == text[a:b]
        cut = rng.randrange(len(text) + 1)
        seq.truncate(cut)
        assert seq.slice(0, seq.num_chars) == text[:cut] and seq.num_chars == cut
