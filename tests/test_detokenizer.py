"""Streaming detokenization reproduces a full decode, and stop strings never leak."""

from __future__ import annotations

import pytest

from jaxserve.detokenizer import IncrementalDetokenizer, StopChecker, find_stop_string

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

LONG_TEXT = (
    "Streaming text, token by token:   three spaces,\ttabs,\n\nnew lines  and  doubles.\n"
    "Emoji 🙂 family 👩‍👩‍👧 flags 🇫🇷🇯🇵 skin tones 👍🏽 and 🦀🐍.\n"
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트.\n"
    "Accents: café, naïve, Ærøskøbing; math ∑ x² ≤ ∞; quotes “like this”.\n"
    "Code:    def f(x):\n        return x  *  2   # trailing   \n"
    "Numbers 1234567890 and 3.14159, end.")


def llama2_style_tokenizer():
    """A sentencepiece-like BPE (Metaspace, byte fallback, decoder strips the first space),
    the kind of tokenizer that drops a word's leading space when decoded without context."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [LONG_TEXT, "Hello world, hello again", "The answer is forty-two, indeed it is."]
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer_tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tokenizer.pre_tokenizer = metaspace
    trainer_tokenizer.train_from_iterator(corpus * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60,
        show_progress=False))
    trained = json.loads(trainer_tokenizer.to_str())["model"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *byte_tokens])}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = metaspace
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


@pytest.fixture(scope="module", params=["smollm2", "tiny-byte-level", "llama2-style"])
def tokenizer(request):
    if request.param == "smollm2":
        default_gguf_path = request.getfixturevalue("default_gguf_path")
        from jaxserve.loader.gguf_loader import gguf_tokenizer

        return gguf_tokenizer(default_gguf_path)
    if request.param == "llama2-style":
        return llama2_style_tokenizer()
    import transformers

    model_dir = request.getfixturevalue("make_tiny_model")("llama")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def continuation(tokenizer, prompt_ids, ids):
    """The text `ids` add after the prompt, as a decode of everything shows it."""
    return tokenizer.decode([*prompt_ids, *ids])[len(tokenizer.decode(prompt_ids)):]


def stream(tokenizer, prompt_ids, ids, chunk=1, **kwargs):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = [detokenizer.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return detokenizer, deltas


def test_token_by_token_text_equals_decoding_all_ids(tokenizer):
    ids = tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    detokenizer, deltas = stream(tokenizer, [], ids)
    assert "".join(deltas) == detokenizer.output_text == tokenizer.decode(ids)
    assert detokenizer.token_ids == ids
    assert not any("\ufffd" in delta for delta in deltas)


def test_after_a_prompt_the_text_equals_the_decoded_continuation(tokenizer):
    prompt_ids = tokenizer.encode("Tell me something:", add_special_tokens=False)
    ids = tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    detokenizer, deltas = stream(tokenizer, prompt_ids, ids)
    assert detokenizer.output_text == continuation(tokenizer, prompt_ids, ids)
    assert not any("\ufffd" in delta for delta in deltas)


def test_byte_pieces_of_a_character_are_held_back_until_complete(tokenizer):
    # Characters absent from the llama2-style training corpus, so its byte fallback must
    # split them (which corpus characters make the trainer's alphabet is a hash-order tie).
    text = "🚀👩‍🚒漢字ü"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    byte_tokens = [t for t in tokenizer.convert_ids_to_tokens(ids) if t.startswith("<0x")]
    assert byte_tokens or any("\ufffd" in piece for piece in pieces), \
        "expected a character split into bytes"
    _, deltas = stream(tokenizer, [], ids)
    assert "" in deltas and "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_several_tokens_per_step_give_the_same_text(tokenizer):
    ids = tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    one_by_one, _ = stream(tokenizer, [], ids, chunk=1)
    by_three, _ = stream(tokenizer, [], ids, chunk=3)
    assert by_three.output_text == one_by_one.output_text


def test_leading_space_of_the_first_word_is_kept(tokenizer):
    all_ids = tokenizer.encode("Hello world, hello again", add_special_tokens=False)
    world = next(i for i, token in enumerate(tokenizer.convert_ids_to_tokens(all_ids))
                 if "world" in token)
    detokenizer, deltas = stream(tokenizer, all_ids[:world], all_ids[world:])
    assert detokenizer.output_text == " world, hello again"
    assert deltas[0].startswith(" ")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept_like_decode(tokenizer, skip):
    text = "Hi there<|im_end|>\n<|im_start|>assistant\nYo 🙂<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    detokenizer, _ = stream(tokenizer, [], ids, skip_special_tokens=skip)
    assert detokenizer.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detokenizer.output_text) is not skip


def test_out_of_vocabulary_ids_add_no_text(tokenizer):
    ids = tokenizer.encode("ok", add_special_tokens=False)
    detokenizer, _ = stream(tokenizer, [], [*ids, len(tokenizer) + 5, -1, *ids])
    assert detokenizer.output_text == tokenizer.decode([*ids, *ids])


def boundary_spanning_stop(tokenizer, ids):
    """A stop string made of the end of one token's text and the start of the next's."""
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    for i in range(2, len(ids)):
        left, right = texts[i - 1][len(texts[i - 2]):], texts[i][len(texts[i - 1]):]
        if len(left) >= 2 and len(right) >= 2 and left.isascii() and right.isascii():
            return left[-2:] + right[:2], len(texts[i - 1])  # stop, where it crosses tokens
    raise AssertionError("no two adjacent multi-character tokens")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_two_tokens_truncates_and_never_streams_early(tokenizer, include):
    ids = tokenizer.encode("The answer is forty-two, indeed it is.", add_special_tokens=False)
    stop, boundary = boundary_spanning_stop(tokenizer, ids)
    full = tokenizer.decode(ids)
    start = full.find(stop)
    assert start < boundary < start + len(stop)  # the match really spans a token boundary

    expected = full[:start + len(stop)] if include else full[:start]

    detokenizer = IncrementalDetokenizer(tokenizer, [])
    checker = StopChecker(["never-appears", stop], include_stop_str_in_output=include)
    streamed, match = "", None
    for token_id in ids:
        delta = detokenizer.step([token_id])
        match = checker.check(detokenizer.output_text, len(delta))
        text = match[1] if match else detokenizer.output_text
        streamed += checker.stream(text, finished=match is not None)
        # what was shown is never taken back: no early glimpse of the stop string
        assert expected.startswith(streamed)
        if match:
            break
    assert match == (stop, expected)
    assert streamed == expected


def test_truncation_never_cuts_text_already_streamed(tokenizer):
    ids = tokenizer.encode("abc ab abd abcd the end", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    checker = StopChecker(["abcd", "abx"])
    streamed = []
    match = None
    for token_id in ids:
        delta = detokenizer.step([token_id])
        match = checker.check(detokenizer.output_text, len(delta))
        final = match[1] if match else detokenizer.output_text
        streamed.append(checker.stream(final, finished=match is not None))
        if match:
            break
    assert match == ("abcd", "abc ab abd ")
    assert "".join(streamed) == "abc ab abd "


def test_unfinished_stream_is_released_when_finished_without_a_match():
    checker = StopChecker(["STOP!"])
    assert checker.holdback == 4
    assert checker.stream("hello ST", finished=False) == "hell"
    assert checker.stream("hello STO", finished=False) == "o"
    assert checker.stream("hello STOP", finished=True) == " STOP"
    assert StopChecker(["STOP!"], include_stop_str_in_output=True).holdback == 0
    assert StopChecker(None).stream("all of it", finished=False) == "all of it"


def test_find_stop_string_prefers_the_earliest_match_and_searches_only_new_text():
    text = "one two three four"
    assert find_stop_string(text, len(text), ["four", "two"]) == ("two", "one ")
    assert find_stop_string(text, len(text), ["four", "two"], True) == ("two", "one two")
    assert find_stop_string(text, 3, ["two"]) is None  # "two" was in older text
    assert find_stop_string(text, 3, ["e fo"]) == ("e fo", "one two thre")  # spans into new text
    assert find_stop_string(text, 0, ["four"]) is None
    assert find_stop_string("ab", 2, ["a", "ab"]) == ("ab", "")  # same start: the longer one
    assert find_stop_string("你好世界", 1, ["好世界"], True) == ("好世界", "你好世界")


@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_equals_the_decode_window_path(tokenizer, skip):
    """DecodeStream (fast tokenizers) emits the same text as the prefix/read-offset path
    (any tokenizer with a decode) for real text, and on random ids once a plain ASCII token
    follows. Random ids that decode to invalid UTF-8 may restart DecodeStream (its prefix
    check fails, as in vLLM), which can drop a U+FFFD: there only the end must agree."""
    import random

    rng = random.Random(7)
    prompt = tokenizer.encode("Hi", add_special_tokens=False)
    for line in LONG_TEXT.splitlines():
        ids = tokenizer.encode(line, add_special_tokens=False)
        _, fast = stream(tokenizer, prompt, ids, skip_special_tokens=skip)
        _, general = stream(tokenizer, prompt, ids, skip_special_tokens=skip,
                            use_decode_stream=False)
        assert "".join(fast) == "".join(general) == continuation(tokenizer, prompt, ids)
    special = sorted(tokenizer.all_special_ids)
    period = tokenizer.encode(".", add_special_tokens=False)
    for trial in range(40):
        ids = [rng.choice(special) if special and rng.random() < 0.05
               else rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        _, fast = stream(tokenizer, prompt, ids + period, chunk=1 + trial % 3,
                         skip_special_tokens=skip)
        _, general = stream(tokenizer, prompt, ids + period, chunk=1 + trial % 3,
                            skip_special_tokens=skip, use_decode_stream=False)
        if "\ufffd" in tokenizer.decode(ids + period, skip_special_tokens=skip):
            assert "".join(fast).endswith(".") and "".join(general).endswith("."), ids
        else:
            assert "".join(fast) == "".join(general), ids


def test_stop_checker_scan_equals_find_stop_string_on_random_texts():
    """StopChecker (longest-first, deduplicated) must pick what the reference
    find_stop_string picks: the earliest match ending in the new text, longest on ties."""
    import random

    rng = random.Random(3)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 12)))
        new = rng.randrange(0, len(text) + 1)
        for include in (False, True):
            assert StopChecker(stops, include).check(text, new) == \
                find_stop_string(text, new, stops, include), (stops, text, new, include)


def test_stop_checker_prefilter_never_skips_a_match():
    """`may_complete(new text)` is the shortcut before `check`: whenever check finds
    a stop string ending in the new text, the prefilter must have said it may."""
    import random

    rng = random.Random(4)
    hits = 0
    for _ in range(3000):
        stops = ["".join(rng.choice("ab]^\\-") for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abc]^\\-") for _ in range(rng.randrange(1, 12)))
        new = rng.randrange(1, len(text) + 1)
        checker = StopChecker(stops)
        if checker.check(text, new) is not None:
            hits += 1
            assert checker.may_complete(text[len(text) - new:]), (stops, text, new)
    assert hits > 300
    assert not StopChecker(["User:"]).may_complete("hello ") and not StopChecker().may_complete("x")


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(tokenizer):
    ids = tokenizer.encode("Hi 🚀", add_special_tokens=False)
    prompt_ids = ids[:-1]          # a byte-split emoji (or at least a shorter prompt)
    out_ids = tokenizer.encode(" ok then", add_special_tokens=False)
    detokenizer, _ = stream(tokenizer, prompt_ids, out_ids)
    assert detokenizer.output_text.strip() == "ok then"
