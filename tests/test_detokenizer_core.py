"""The stateless detokenizer: tokens fed in random steps, each DetokItem built from
make_context as the scheduler builds it and sent through the wire codec, must give deltas
that concatenate to the full decode, never show a broken character, never leak a stop
string, and never change text already sent."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from common.messages import (Abort, DetokItem, MessageError, StepLogprobs, TextDelta,
                             TokenLogprobs, decode, encode)
from common.token_columns import batch_items, token_batch
from common.sampling_params import SamplingParams
from common.detok_window import detok_params, make_context, stop_lookback
from common.token_text import TokenTexts
from services.detokenizer.core import Detokenizer, TokenBytes, find_stop, unfinished_bytes
from tests.text_fixtures import SAMPLE_TEXTS, byte_fallback_tokenizer, smollm2_tokenizer

REPLACEMENT = "\ufffd"
PROMPT = "Write something, please:"


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def detok(tok):
    return Detokenizer(tok)


@dataclass
class Run:
    deltas: list[TextDelta] = field(default_factory=list)
    aborts: list[Abort] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)  # text sent so far, after each step

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)


def detok_item(prompt: list[int], outputs: list[int], seq: int, num_new: int,
               params: SamplingParams, finish_reason: str | None = None,
               logprobs: list[TokenLogprobs] | None = None) -> DetokItem:
    """What the scheduler sends for the num_new tokens after `seq`, through the codec."""
    context, num_context_prompt = make_context(prompt, outputs[:seq + num_new], num_new,
                                               stop_lookback(params.stop))
    item = DetokItem("r1", 0, "gw", seq, outputs[seq:seq + num_new], context,
                     num_context_prompt, detok_params(params), len(prompt), finish_reason,
                     None, logprobs or [])
    return batch_items(decode(encode(token_batch(0, [item]))))[0]


def run(detok: Detokenizer, prompt: list[int], outputs: list[int], params: SamplingParams,
        rng: random.Random, finish_reason: str = "length", max_chunk: int = 8) -> Run:
    """Feed the outputs in random steps until they end or a stop string aborts them."""
    result, seq = Run(), 0
    while seq < len(outputs):
        n = min(rng.randint(1, max_chunk), len(outputs) - seq)
        last = seq + n == len(outputs)
        delta, abort = detok.process(detok_item(prompt, outputs, seq, n, params,
                                                finish_reason if last else None))
        assert delta.seq == seq and delta.token_ids == outputs[seq:seq + n]
        result.deltas.append(delta)
        result.sent.append(result.text)
        seq += n
        if abort is not None:
            result.aborts.append(abort)
            break
    return result


def output_text(tokenizer, prompt: list[int], outputs: list[int], **kw) -> str:
    """The text the outputs add after the prompt, from one decode of everything."""
    full = tokenizer.decode(prompt + outputs, clean_up_tokenization_spaces=False, **kw)
    return full[len(tokenizer.decode(prompt, clean_up_tokenization_spaces=False, **kw)):]


def assert_never_rewrites(result: Run, final: str) -> None:
    for sent in result.sent:
        assert final.startswith(sent)


# --- incremental text ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SAMPLE_TEXTS))
def test_deltas_concatenate_to_the_full_decode(tok, detok, name):
    rng = random.Random(name)
    prompt = tok.encode(PROMPT)
    outputs = tok.encode(SAMPLE_TEXTS[name] * 2)
    expected = tok.decode(outputs, skip_special_tokens=True)
    for _ in range(8):
        result = run(detok, prompt, outputs, SamplingParams(), rng)
        assert result.text == expected
        assert_never_rewrites(result, expected)
        assert not any(REPLACEMENT in d.text for d in result.deltas)
        assert result.deltas[-1].finish_reason == "length" and not result.aborts


def test_ascii_text_is_sent_as_soon_as_it_is_decoded(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(SAMPLE_TEXTS["code"])
    result = run(detok, prompt, outputs, SamplingParams(), random.Random(1), max_chunk=1)
    assert result.sent == [tok.decode(outputs[:i + 1]) for i in range(len(outputs))]


def test_emoji_waits_for_its_last_byte_token(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(" 🎉")
    assert len(outputs) > 1 and REPLACEMENT in tok.decode(outputs[:-1])
    result = run(detok, prompt, outputs, SamplingParams(), random.Random(0), max_chunk=1)
    assert [d.text for d in result.deltas[:-1]] == [""] * (len(outputs) - 1)
    assert result.deltas[-1].text == " 🎉"


def test_a_character_cut_by_the_last_token_is_dropped_as_vllm_does(tok, detok):
    prompt, emoji = tok.encode(PROMPT), tok.encode(" 🎉")
    outputs = tok.encode(" party") + emoji[:-1]
    assert REPLACEMENT in tok.decode(outputs)
    result = run(detok, prompt, outputs, SamplingParams(), random.Random(0))  # max_tokens
    assert result.text == tok.decode(outputs).rstrip(REPLACEMENT) == " party "


@pytest.mark.parametrize("seed", range(6))
def test_random_token_ids_concatenate_to_the_full_decode(tok, detok, seed):
    rng = random.Random(seed)
    partial = [i for i in range(256, 4000) if invalid_utf8(TokenBytes(tok).piece(i, False))]
    prompt = tok.encode(PROMPT)
    outputs = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(len(tok))
               for _ in range(rng.randint(20, 120))]
    skip = seed % 2 == 0
    params = SamplingParams(skip_special_tokens=skip)
    expected = tok.decode(outputs, skip_special_tokens=skip)
    if TokenBytes(tok).num_unfinished(outputs, skip):
        expected = expected.rstrip(REPLACEMENT)  # a character cut by the end is dropped
    result = run(detok, prompt, outputs, params, rng)
    assert result.text == expected
    assert_never_rewrites(result, expected)


@pytest.mark.parametrize("seed", range(6))
def test_the_text_is_the_same_in_one_item_as_a_token_at_a_time(tok, detok, seed):
    """A FINAL_ONLY completion comes as one item; a streamed one a token at a time. Bytes
    that are no character (U+FFFD) just before a character cut by the end are the case
    that once differed: a token at a time had sent them, one item dropped them."""
    rng = random.Random(seed)
    partial = [i for i in range(256, 4000) if invalid_utf8(TokenBytes(tok).piece(i, False))]
    lone, lead = (next(i for i in range(len(tok)) if TokenBytes(tok).piece(i, False) == b)
                  for b in (b"\x80", b"\xe2"))  # no character; a cut one at the end
    prompt = tok.encode(PROMPT)
    outputs = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(len(tok))
               for _ in range(rng.randint(5, 60))] + [lone, lead][:seed % 3]
    params = SamplingParams(skip_special_tokens=seed % 2 == 0)
    one_token = run(detok, prompt, outputs, params, rng, max_chunk=1)
    one_item, _ = detok.process(detok_item(prompt, outputs, 0, len(outputs), params,
                                           "length"))
    assert one_item.text == one_token.text == run(detok, prompt, outputs, params, rng).text
    assert not any(sent.endswith(REPLACEMENT) for sent in one_token.sent[:-1])


@pytest.mark.parametrize("seed", range(4))
def test_plain_items_read_their_bytes_as_the_window_decode_would(tok, seed, monkeypatch):
    """Items the plain path takes (services/detokenizer/core.py _plain_text) give the
    deltas that decoding their windows gives, over text and random ids: byte tokens that
    are no character, characters cut across steps, special tokens shown and skipped."""
    rng = random.Random(seed)
    partial = [i for i in range(256, 4000) if invalid_utf8(TokenBytes(tok).piece(i, False))]
    text = tok.encode(SAMPLE_TEXTS[sorted(SAMPLE_TEXTS)[seed % len(SAMPLE_TEXTS)]])
    outputs = text + [rng.choice(partial) if rng.random() < 0.3 else rng.randrange(len(tok))
                      for _ in range(80)] + text
    params = SamplingParams(skip_special_tokens=seed % 2 == 0)
    plain, windowed = Detokenizer(tok), Detokenizer(tok)
    monkeypatch.setattr(windowed, "_plain_text", lambda item: None)
    taken = 0
    for seq in range(len(outputs)):
        item = detok_item(tok.encode(PROMPT), outputs, seq, 1, params)
        taken += plain._plain_text(item) is not None
        assert plain.process(item) == windowed.process(item), seq
    assert taken > 20  # the plain path was taken, not only the window's
    # a token that is U+FFFD itself: the window's text holds it back, as bytes of no
    # character, until a character follows
    replaced = tok.encode("ab \ufffd")
    item = detok_item(tok.encode(PROMPT), replaced, len(replaced) - 1, 1, params)
    assert plain.process(item) == windowed.process(item)


def invalid_utf8(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return True
    return False


@pytest.mark.parametrize("name", sorted(SAMPLE_TEXTS))
def test_byte_fallback_runs_never_show_replacement_characters(name):
    # Byte-fallback decoders show a whole run of byte tokens as U+FFFD while any of it is
    # incomplete; the window must start and end on character boundaries.
    tok = byte_fallback_tokenizer()
    detok, rng = Detokenizer(tok), random.Random(name)
    prompt, outputs = tok.encode(PROMPT), tok.encode(SAMPLE_TEXTS[name] * 3)
    expected = output_text(tok, prompt, outputs, skip_special_tokens=True)
    assert REPLACEMENT not in expected
    for _ in range(4):
        result = run(detok, prompt, outputs, SamplingParams(), rng)
        assert result.text == expected
        assert_never_rewrites(result, expected)
        assert not any(REPLACEMENT in d.text for d in result.deltas)


def test_special_tokens_are_skipped_or_shown(tok, detok):
    prompt = tok.encode(PROMPT)
    outputs = tok.encode("Hi there") + [tok.eos_token_id]
    shown = run(detok, prompt, outputs, SamplingParams(skip_special_tokens=False),
                random.Random(0), finish_reason="length")
    skipped = run(detok, prompt, outputs, SamplingParams(), random.Random(0),
                  finish_reason="length")
    assert shown.text == "Hi there<|im_end|>" and skipped.text == "Hi there"


@pytest.mark.parametrize("stop_reason", [None, 17])
def test_a_stop_token_ends_the_text_without_appearing_in_it(tok, detok, stop_reason):
    prompt = tok.encode(PROMPT)
    last = tok.eos_token_id if stop_reason is None else stop_reason
    outputs = tok.encode("Hi there") + [last]
    item = detok_item(prompt, outputs, 0, len(outputs), SamplingParams(skip_special_tokens=False),
                      "stop")
    item = DetokItem(**{**{f: getattr(item, f) for f in item.__slots__},
                        "stop_reason": stop_reason})
    delta, _ = detok.process(item)
    assert delta.text == "Hi there" and delta.token_ids == outputs
    kept = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    item = DetokItem(**{**{f: getattr(item, f) for f in item.__slots__},
                        "params": detok_params(kept)})
    assert detok.process(item)[0].text == "Hi there" + tok.decode([last])


def test_delta_carries_the_item_fields(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode("Done.") + [2]  # ends on stop id 2
    item = detok_item(prompt, outputs, 0, len(outputs), SamplingParams(), "stop")
    item = DetokItem(**{**{f: getattr(item, f) for f in item.__slots__}, "stop_reason": 2})
    delta, abort = detok.process(item)
    assert (delta.rid, delta.index, delta.seq, delta.token_ids, delta.num_prompt_tokens,
            delta.finish_reason, delta.stop_reason, delta.text) == (
        "r1", 0, 0, outputs, len(prompt), "stop", 2, "Done.")
    assert abort is None


# --- stop strings ------------------------------------------------------------------------

STORY = " Once upon a time there was a fox. The END of it all. More text follows here."


def test_stop_string_ends_the_text_and_aborts(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(STORY)
    params = SamplingParams(stop=["END"])
    for seed in range(10):
        result = run(detok, prompt, outputs, params, random.Random(seed))
        assert result.text == " Once upon a time there was a fox. The "
        last = result.deltas[-1]
        assert (last.finish_reason, last.stop_reason) == ("stop", "END")
        assert result.aborts == [Abort("r1", 0, reason="stop", stop_reason="END")]
        assert_never_rewrites(result, result.text)


def test_stop_string_spanning_two_steps_is_found(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(STORY)
    stop = " fox. The"
    params = SamplingParams(stop=[stop])
    # one token per step: the stop string covers several tokens, so several steps
    assert len(tok.encode(stop)) > 1
    result = run(detok, prompt, outputs, params, random.Random(0), max_chunk=1)
    assert result.text == " Once upon a time there was a"
    assert result.deltas[-1].stop_reason == stop and len(result.aborts) == 1


def test_include_stop_str_in_output(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(STORY)
    params = SamplingParams(stop=["was a fox"], include_stop_str_in_output=True)
    for seed in range(6):
        result = run(detok, prompt, outputs, params, random.Random(seed), max_chunk=3)
        assert result.text == " Once upon a time there was a fox"
        assert result.deltas[-1].stop_reason == "was a fox"


def test_held_back_text_never_shows_part_of_a_stop_string(tok, detok):
    # "Sto" and "Stop" appear before the full stop string "Stop!": each is held back
    # until the next characters decide it, and never reaches the client.
    text = " Sto Stop Stopped Stop! after"
    prompt, outputs = tok.encode(PROMPT), tok.encode(text)
    params = SamplingParams(stop=["Stop!"])
    for seed in range(10):
        result = run(detok, prompt, outputs, params, random.Random(seed), max_chunk=2)
        assert result.text == " Sto Stop Stopped "
        seen = 0
        for sent, delta in zip(result.sent, result.deltas):
            decoded = tok.decode(outputs[:delta.seq + len(delta.token_ids)])
            assert " Sto Stop Stopped ".startswith(sent)
            if delta.finish_reason is None:  # undecided: the last 4 characters are held
                assert len(sent) <= max(0, len(decoded) - (len("Stop!") - 1))
            seen = len(sent)
        assert seen == len(result.text)


def test_finish_by_length_flushes_held_text(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(" hello world")
    params = SamplingParams(stop=["a very long stop string"])
    result = run(detok, prompt, outputs, params, random.Random(0), max_chunk=1)
    assert [d.text for d in result.deltas[:-1]] == [""] * (len(outputs) - 1)
    assert result.text == " hello world" and result.deltas[-1].finish_reason == "length"
    assert not result.aborts


def test_stop_string_in_the_final_item_needs_no_abort(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(" one two three")
    params = SamplingParams(stop=["two"])
    delta, abort = detok.process(detok_item(prompt, outputs, 0, len(outputs), params, "length"))
    assert (delta.text, delta.finish_reason, delta.stop_reason) == (" one ", "stop", "two")
    assert abort is None  # the scheduler already ended the request


def test_items_after_a_stop_do_not_abort_again(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(" one two three four")
    params = SamplingParams(stop=["two"])
    first, abort = detok.process(detok_item(prompt, outputs, 0, 3, params))
    assert first.text == " one " and abort is not None
    late, abort = detok.process(detok_item(prompt, outputs, 3, 1, params))
    assert abort is None and late.seq == 3  # the gateway drops it: seq past the stop


def test_the_stop_string_completed_first_wins_whatever_the_steps(tok, detok):
    text = " alpha beta gamma delta"
    prompt, outputs = tok.encode(PROMPT), tok.encode(text)
    params = SamplingParams(stop=["beta gamma delta", "gamma", "a g"])
    for seed in range(10):
        result = run(detok, prompt, outputs, params, random.Random(seed))
        assert (result.text, result.deltas[-1].stop_reason) == (" alpha bet", "a g")


def test_long_emoji_stop_string_across_byte_tokens(tok, detok):
    # each emoji is several byte-level tokens; the window must hold the whole look-back
    stop = "🎉🎉🎉🎉🎉🎉"
    prompt = tok.encode(PROMPT)
    outputs = tok.encode(" party " + "🎉" * 5 + " wait " + stop + " and after that, more")
    for include in (False, True):
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
        for seed in range(4):
            result = run(detok, prompt, outputs, params, random.Random(seed), max_chunk=2)
            assert result.text == " party " + "🎉" * 5 + " wait " + (stop if include else "")
            assert len(result.aborts) == 1


def test_find_stop_and_lookback():
    assert find_stop("abcabc", ["c", "bca"], 0).stop == "c"
    assert find_stop("abcabc", ["c", "bca"], 3).start == 5
    assert find_stop("xyz", ["q"], 0) is None
    assert stop_lookback([]) == 0 and stop_lookback(["ab", "abcd"]) == 3


# --- the context protocol ---------------------------------------------------------------

def test_make_context_takes_the_tokens_before_the_new_ones():
    ids = list(range(100))
    context, num_prompt = make_context(ids[:90], ids[90:], 2, 0)
    assert context == ids[82:98] and num_prompt == 8
    context, num_prompt = make_context(ids[:10], ids[10:], 5, 0)
    assert context == ids[79:95] and num_prompt == 0
    longer, _ = make_context(ids[:10], ids[10:], 5, 5)
    assert longer == ids[59:95]
    short, num_prompt = make_context(ids[:4], ids[4:6], 2, 3)
    assert short == ids[:4] and num_prompt == 4


def test_make_context_rejects_new_tokens_inside_the_prompt():
    with pytest.raises(ValueError, match="do not fit"):
        make_context(list(range(8)), [8, 9], 3, 0)


def test_unfinished_bytes_finds_a_cut_character():
    euro = "€".encode()
    assert unfinished_bytes(b"ab" + euro) == 0
    assert unfinished_bytes(b"ab" + euro[:2]) == 2
    assert unfinished_bytes(b"a" + "🎉".encode()[:3]) == 3
    assert unfinished_bytes(b"\x80\x80") == 0


def test_token_bytes_spell_byte_level_and_byte_fallback_pieces(tok):
    level = TokenBytes(tok)
    ids = tok.encode(" 🎉")
    assert level.byte_level and b"".join(level.piece(i, False) for i in ids) == " 🎉".encode()
    assert level.piece(tok.eos_token_id, True) == b""
    fallback_tok = byte_fallback_tokenizer()
    fallback = TokenBytes(fallback_tok)
    ids = fallback_tok.encode("€")
    assert not fallback.byte_level
    assert b"".join(fallback.piece(i, False) for i in ids).endswith("€".encode())


# --- logprob texts ------------------------------------------------------------------------

def test_logprob_texts_are_single_token_decodes(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(" world 🎉")
    top = [outputs[0], tok.eos_token_id, tok.encode(" hello")[0]]
    lp = TokenLogprobs(top, [-0.1, -2.0, -3.0], 1)
    item = detok_item(prompt, outputs, 0, 1, SamplingParams(logprobs=2), logprobs=[lp])
    delta, _ = detok.process(item)
    assert delta.logprobs[0].texts == [" world", "<|im_end|>", " hello"]
    assert delta.logprobs[0].token_ids == top and delta.logprobs[0].rank == 1
    partial = [i for i in outputs if REPLACEMENT in tok.decode([i])]
    assert partial and detok.token_text(partial[0]) == tok.decode([partial[0]])


def test_prompt_logprob_rows_get_texts_and_none_stays_none(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(" ok")
    rows = [None, TokenLogprobs([prompt[1], 5], [-1.0, -2.0], 3)]
    item = detok_item(prompt, outputs, 0, 1, SamplingParams(prompt_logprobs=1))
    item = DetokItem(**{**{f: getattr(item, f) for f in item.__slots__},
                        "prompt_logprobs": rows})
    delta, _ = detok.process(item)
    assert delta.prompt_logprobs[0] is None
    assert delta.prompt_logprobs[1].texts == [tok.decode([prompt[1]]), tok.decode([5])]


def test_logprob_texts_keep_sentencepiece_leading_spaces():
    tok = byte_fallback_tokenizer()
    the = tok.convert_tokens_to_ids("\u2581the")
    assert tok.decode([the]) == "the"  # the decoder strips a text's first space
    assert Detokenizer(tok).token_text(the) == " the"


@pytest.mark.parametrize("rust", [True, False])
@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_texts_looked_up_together_are_each_ids_own(tok, kind, rust, monkeypatch):
    """A batch of ids (repeats, special tokens, byte pieces and SentencePiece word starts
    among them) through the one-call lookup, in a table partly filled an id at a time:
    each the single-token decode, leading spaces restored, and in the order asked; from
    the Rust tokenizer's batch and from transformers' decode a token at a time."""
    tokenizer = tok if kind == "byte-level" else byte_fallback_tokenizer()
    ids = tokenizer.encode(" the world 🎉 €, east of the sun") + [tokenizer.eos_token_id]
    ids = ids + ids[::-1] + random.Random(0).sample(range(len(tokenizer)), 50)
    if not rust:
        monkeypatch.setattr("common.token_text.rust_decoder", lambda tokenizer: None)
    texts = TokenTexts(tokenizer)
    one_at_a_time = [TokenTexts(tokenizer)(i) for i in ids]
    texts(ids[3])
    assert texts.texts(ids) == one_at_a_time
    assert one_at_a_time[:3] == [_marked(tokenizer, i) for i in ids[:3]]


def test_a_batchs_logprob_columns_go_to_its_items_with_their_texts(tok, detok):
    """items_of: row i of the batch's columns is items[i]'s logprobs, spelled as one id at
    a time; an item without a row keeps its own; a batch whose rows do not match its
    items, or an item with both, is refused."""
    params = SamplingParams()
    own = [TokenLogprobs([5], [-0.5], 1)]  # float32-exact, as it comes off the wire
    items = [detok_item([1, 2], [10, 11], 0, 1, params),
             detok_item([1, 2], [10, 11], 1, 1, params, logprobs=own),
             detok_item([1, 2], [12], 0, 1, params)]
    columns = StepLogprobs([2, 0, 1], [10, 300, 12], [-0.5, -1.0, -0.25], [1, 4])
    batch = decode(encode(token_batch(3, items, logprobs=columns)))
    got = detok.items_of(batch)
    spelled = TokenTexts(tok)
    assert [item.logprobs for item in got] == [
        [TokenLogprobs([10, 300], [-0.5, -1.0], 1, [spelled(10), spelled(300)])], own,
        [TokenLogprobs([12], [-0.25], 4, [spelled(12)])]]
    assert detok.items_of(token_batch(3, items)) == items
    with pytest.raises(MessageError, match="logprobs for 2"):
        detok.items_of(token_batch(3, items, logprobs=columns.select([0, 2])))
    with pytest.raises(MessageError, match="of its own"):
        detok.items_of(token_batch(3, items, logprobs=columns.select([0, 0, 2])))


def test_preloaded_texts_are_those_looked_up_one_at_a_time(tok):
    """preload fills the table for every id the model may sample, those past the
    tokenizer's own (a model's padded vocabulary) included, with the texts the lookup
    finds an id at a time; the lookup then decodes nothing."""
    vocab_size = len(tok) + 64
    ids = random.Random(1).sample(range(vocab_size), 300) + [len(tok) + 3, 0]
    preloaded = TokenTexts(tok)
    preloaded.preload(vocab_size)
    lazy = TokenTexts(tok)
    assert preloaded.texts(ids) == [lazy(i) for i in ids]
    assert len(preloaded._texts) == vocab_size
    preloaded.tokenizer = preloaded._rust = None  # any decode now fails
    assert preloaded.texts(ids[::-1]) == [lazy(i) for i in ids[::-1]]


def _marked(tokenizer, token_id: int) -> str:
    """decode([id]) with the SentencePiece word start it strips put back."""
    text = tokenizer.decode([token_id])
    return (" " + text if tokenizer.convert_ids_to_tokens(token_id).startswith("\u2581")
            and not text.startswith(" ") else text)


# --- randomized: stop strings against a one-shot reference ------------------------------

PIECES = [*"abc xyz.,!\n", *"東京日本我书", "🎉", "👍🏽", "é", "ñ", "ß", "€", "𝔘"]


def reference(full: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """The text up to the stop string completed first, found in the whole decoded text."""
    found = [(at + len(s), i, at, s) for i, s in enumerate(stop) if (at := full.find(s)) >= 0]
    if not found:
        return full, None
    end, _, at, s = min(found)
    return full[:end if include else at], s


@pytest.mark.parametrize("which", ["byte_level", "byte_fallback"])
def test_random_texts_and_stop_strings_match_a_one_shot_reference(which):
    tok = smollm2_tokenizer() if which == "byte_level" else byte_fallback_tokenizer()
    detok = Detokenizer(tok)
    for seed in range(60):
        rng = random.Random(seed)
        text = "".join(rng.choices(PIECES, k=rng.randint(5, 50)))
        prompt = tok.encode("".join(rng.choices(PIECES, k=rng.randint(1, 8))))
        outputs = tok.encode(text)
        full = output_text(tok, prompt, outputs, skip_special_tokens=True)
        stop = [full[i:i + rng.randint(1, 8)] for i in rng.sample(range(len(full)), 2)]
        stop.append("".join(rng.choices(PIECES, k=3)))
        include = rng.random() < 0.5
        expected, stop_reason = reference(full, stop, include)
        params = SamplingParams(stop=stop, include_stop_str_in_output=include)
        result = run(detok, prompt, outputs, params, rng)
        assert result.text == expected, (seed, text, stop, include)
        last = result.deltas[-1]
        assert last.stop_reason == stop_reason
        # a stop before the last item aborts; one in the last item ends with it anyway
        assert len(result.aborts) == int(last.seq + len(last.token_ids) < len(outputs))
        assert_never_rewrites(result, expected)


def test_any_replica_gives_the_same_deltas_in_any_order(tok, detok):
    prompt, outputs = tok.encode(PROMPT), tok.encode(SAMPLE_TEXTS["emoji"])
    params = SamplingParams(stop=["done"])
    items = [detok_item(prompt, outputs, seq, 1, params) for seq in range(len(outputs))]
    in_order = [detok.process(item) for item in items]
    other = Detokenizer(tok)
    assert [other.process(item) for item in reversed(items)] == in_order[::-1]
