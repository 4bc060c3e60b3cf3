"""engines/output.py: incremental detokenization, stop strings, deltas and the batcher's hand-off
to event loops, against a full decode (`tokenizer.decode(all ids)`) of the default tokenizer
(SmolLM2, byte-level BPE) and of a byte-fallback tokenizer built offline (sentencepiece style)."""

import asyncio
import threading
from functools import partial

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engines.base import TokenLogprob
from engines.output import (
    ChoiceOutput,
    LoopHandoff,
    OffsetDetokenizer,
    RequestOutputCollector,
    StreamDetokenizer,
    WorkerHandoff,
    make_detokenizer,
)

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Text that byte-level and byte-fallback tokenizers split inside characters: emoji (4 bytes, some
# with joiners and variation selectors), CJK (3 bytes), accented Latin (2 bytes).
MULTIBYTE = "😀👍🏽👨‍👩‍👧❤️世界你好語éüñß ab.\n"


@pytest.fixture(scope="module")
def smollm2(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def byte_fallback():
    """A sentencepiece-style BPE (Llama's decoder: "▁" -> " ", byte-fallback pieces `<0xNN>`,
    the first leading space stripped), built offline."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁the", "▁a", "he", "llo", "▁hello", "世", "界", "▁世界", "é", "ü", "▁caf", "a", "b", "▁b",
                  ".", "▁.", "▁ab"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return TokenizersBackend(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["smollm2", "byte_fallback"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def token_ids(tokenizer, max_size=40):
    """Random ids, biased to the low ids (special and byte tokens) where characters split."""
    size = len(tokenizer)
    return st.lists(st.one_of(st.integers(0, size - 1), st.integers(0, min(size, 300) - 1), st.integers(0, 8)),
                    min_size=1, max_size=max_size)


def utf8_token_ids(tokenizer, max_size=40):
    """Random ids whose byte tokens form whole UTF-8 characters. A byte-fallback tokenizer
    decodes a run of byte tokens that is not valid UTF-8 as one U+FFFD per byte, those of valid
    characters before it included, so no stream reproduces its full decode (tokens passed on
    cannot be taken back); such ids are compared with the old scheme instead."""
    byte_id = tokenizer.convert_tokens_to_ids("<0x00>")
    if byte_id in (None, tokenizer.unk_token_id):  # byte-level BPE: every sequence decodes incrementally
        return token_ids(tokenizer, max_size)
    char = st.sampled_from(MULTIBYTE + "xyz").map(lambda c: [byte_id + b for b in c.encode()])
    other = st.one_of(st.integers(0, 2), st.integers(byte_id + 256, len(tokenizer) - 1)).map(lambda i: [i])
    return st.lists(st.one_of(char, other), min_size=1, max_size=max_size // 2).map(lambda p: sum(p, []))


def run_choice(tokenizer, ids, *, stop=(), skip=True, last="length", take_every=1, detokenizer=None):
    """Feed `ids` to a `ChoiceOutput` as the huggingface engine does, the last with `last`
    ("length", or "stop": a stop token), taking a delta after every `take_every` tokens (a
    consumer that lags takes several at once). Returns (deltas, the choice)."""
    choice = ChoiceOutput(0, stop, detokenizer=detokenizer or make_detokenizer(tokenizer, skip))
    deltas = []
    for i, token in enumerate(ids):
        end = i == len(ids) - 1
        choice.add_token(token, TokenLogprob(token, "", -1.0), last if end else None,
                         token if end and last == "stop" else None)
        if end or choice.finished or (i + 1) % take_every == 0:
            if (delta := choice.take_delta()) is not None:
                deltas.append(delta)
        if choice.finished:
            break
    return deltas, choice


def text_of(deltas):
    return "".join(d.text for d in deltas)


def test_the_default_tokenizers_use_decode_stream(smollm2, byte_fallback):
    assert isinstance(make_detokenizer(smollm2, True), StreamDetokenizer)
    assert isinstance(make_detokenizer(byte_fallback, False), StreamDetokenizer)


@PROPERTY
@given(data=st.data(), skip=st.booleans(), take_every=st.integers(1, 4))
def test_deltas_concatenate_to_the_full_decode(tokenizer, data, skip, take_every):
    ids = data.draw(utf8_token_ids(tokenizer))
    deltas, choice = run_choice(tokenizer, ids, skip=skip, take_every=take_every)
    assert text_of(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert sum(d.num_tokens for d in deltas) == choice.num_tokens == len(ids)
    assert sum(len(d.logprobs or []) for d in deltas) == len(ids)


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_the_offset_scheme_gives_the_full_decode_too(tokenizer, data, skip):
    ids = data.draw(utf8_token_ids(tokenizer))
    detokenizer = OffsetDetokenizer(partial(tokenizer.decode, skip_special_tokens=skip))
    deltas, _ = run_choice(tokenizer, ids, skip=skip, detokenizer=detokenizer)
    assert text_of(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


@PROPERTY
@given(text=st.text(alphabet=MULTIBYTE, min_size=1, max_size=30))
def test_multibyte_characters_are_never_split_or_replaced(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in full
    deltas, _ = run_choice(tokenizer, ids)
    assert text_of(deltas) == full
    assert not any("\ufffd" in d.text for d in deltas)


@PROPERTY
@given(data=st.data(), take_every=st.integers(1, 3))
def test_a_stop_string_cuts_the_full_text_at_its_first_occurrence(tokenizer, data, take_every):
    ids = data.draw(utf8_token_ids(tokenizer))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    if not full:
        return
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start:start + data.draw(st.integers(1, 6))]
    deltas, choice = run_choice(tokenizer, ids, stop=[stop], take_every=take_every)
    assert text_of(deltas) == full[:full.index(stop)]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    # the tokens up to the one that completed the stop string are counted, none after it
    assert sum(d.num_tokens for d in deltas) == choice.num_tokens <= len(ids)
    # no delta before the last passes on a part of the stop string
    assert all(stop not in text_of(deltas[:i + 1]) for i in range(len(deltas)))


def old_scheme(tokenizer, ids, stop=(), skip=True):
    """The huggingface engine's output before engines/output.py (`_advance`: the whole output
    decoded again at every token; text up to the last U+FFFD and the stop-string hold passed on,
    stop strings searched from the last characters passed on; the last token ends it with
    "length"): (text, finish_reason, stop_reason)."""
    hold = max((len(s) for s in stop), default=1) - 1
    emitted = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        start = max(0, len(emitted) - hold)
        hits = [(pos, s) for s in stop if (pos := text.find(s, start)) != -1]
        if hits:
            pos, s = min(hits)
            return emitted + text[len(emitted):pos], "stop", s
        safe_end = len(text) if k == len(ids) else min(len(text.rstrip("\ufffd")), len(text) - hold)
        emitted += text[len(emitted):max(safe_end, len(emitted))]
    return emitted, "length", None


@PROPERTY
@given(data=st.data(), skip=st.booleans(), take_every=st.integers(1, 3))
def test_any_ids_give_the_text_the_full_decode_scheme_gave(tokenizer, data, skip, take_every):
    ids = data.draw(token_ids(tokenizer))
    # Where a longer decode rewrites text a shorter one had completed, no stream can follow it (a
    # byte-fallback space `<0x20>` turns into U+FFFD once a stray continuation byte follows it),
    # and the two schemes recover differently: such ids are not compared.
    decodes = [tokenizer.decode(ids[:k], skip_special_tokens=skip) for k in range(1, len(ids) + 1)]
    assume(all(later.startswith(earlier.rstrip("\ufffd")) for earlier, later in zip(decodes, decodes[1:])))
    deltas, _ = run_choice(tokenizer, ids, skip=skip, take_every=take_every)
    assert (text_of(deltas), deltas[-1].finish_reason) == old_scheme(tokenizer, ids, skip=skip)[:2]


def first_stop(tokenizer, ids, stop, skip=True):
    """Where a stream stops, by definition: at the first token after which a stop string occurs
    in the decoded text, cut at the earliest occurrence then (as vLLM's and the old scheme's
    search); (text, finish_reason, stop_reason). Earlier stop strings complete first, so with
    several the result is not the earliest occurrence in the whole text."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        hits = [(pos, s) for s in stop if (pos := text.find(s)) != -1]
        if hits:
            pos, s = min(hits)
            return text[:pos], "stop", s
    return tokenizer.decode(ids, skip_special_tokens=skip), "length", None


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_several_stop_strings_end_the_choice_at_the_first_one_completed(tokenizer, data, skip):
    """The old scheme's hold counted U+FFFD characters, so it could pass on the first character
    of a stop string ending in an emoji split over byte tokens ("the👧" with stop "e👧" gave
    "the"); the reference here is the definition."""
    ids = data.draw(utf8_token_ids(tokenizer))
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    pieces = st.text(alphabet=full + "ab", min_size=1, max_size=4) if full else st.just("ab")
    stop = data.draw(st.lists(pieces, min_size=1, max_size=3, unique=True))
    deltas, _ = run_choice(tokenizer, ids, stop=stop, skip=skip)
    assert (text_of(deltas), deltas[-1].finish_reason, deltas[-1].stop_reason) == first_stop(tokenizer, ids, stop,
                                                                                              skip)


def test_a_stop_string_ending_in_a_split_emoji_is_never_partly_passed_on(byte_fallback):
    ids = byte_fallback.convert_tokens_to_ids(["▁the", "<0xF0>", "<0x9F>", "<0x91>", "<0xA7>"])
    assert byte_fallback.decode(ids) == "the👧"
    deltas, _ = run_choice(byte_fallback, ids, stop=["e👧"], skip=False)
    assert (text_of(deltas), deltas[-1].stop_reason) == ("th", "e👧")


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_a_stop_token_ends_the_choice_without_its_text(tokenizer, data, skip):
    ids = data.draw(utf8_token_ids(tokenizer, max_size=30)) + [tokenizer.eos_token_id]
    deltas, choice = run_choice(tokenizer, ids, skip=skip, last="stop")
    assert text_of(deltas) == tokenizer.decode(ids[:-1], skip_special_tokens=skip)
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", tokenizer.eos_token_id)
    assert choice.num_tokens == len(ids)  # the stop token is counted, as usage counts it


def test_skip_special_tokens_both_ways(smollm2):
    ids = smollm2.encode("Hi there", add_special_tokens=False)
    ids = [smollm2.convert_tokens_to_ids("<|im_start|>")] + ids + [smollm2.convert_tokens_to_ids("<|im_end|>")] + ids
    kept, _ = run_choice(smollm2, ids, skip=False)
    skipped, _ = run_choice(smollm2, ids, skip=True)
    assert text_of(kept) == "<|im_start|>Hi there<|im_end|>Hi there"
    assert text_of(skipped) == "Hi thereHi there"


def test_text_that_may_begin_a_stop_string_waits_for_the_next_token(smollm2):
    ids = smollm2.encode("The capital is Paris, France", add_special_tokens=False)
    choice = ChoiceOutput(0, ["Paris,"], detokenizer=make_detokenizer(smollm2, True))
    seen = []
    for token in ids:
        choice.add_token(token)
        if (delta := choice.take_delta()) is not None:
            seen.append(delta.text)
        assert not "".join(seen).endswith(("P", "Pa", "Par", "Pari", "Paris"))
    assert "".join(seen) == "The capital is " and choice.stop_reason == "Paris,"


def test_text_engines_hold_back_and_trim_as_sglang_sends_them():
    choice = ChoiceOutput(0, ["Paris"], find_stops=False)
    choice.set_text("It is Par", 3)
    assert choice.take_delta().text == "It is"
    choice.set_text("It is", 4)  # the server trimmed the matched stop string
    choice.finish("stop", "Paris")
    delta = choice.take_delta()
    assert (delta.text, delta.num_tokens, delta.finish_reason, delta.stop_reason) == ("", 1, "stop", "Paris")
    assert choice.take_delta() is None


def test_delta_text_without_hold_is_passed_on_as_it_comes():
    choice = ChoiceOutput(0, ["xyz"], find_stops=False, hold_stop_prefix=False)
    choice.add_text("ab", 1, [TokenLogprob(5, "ab", -0.5)])
    delta = choice.take_delta()
    assert (delta.text, delta.num_tokens, [t.token_id for t in delta.logprobs]) == ("ab", 1, [5])
    choice.add_text("", 1)
    assert choice.take_delta() is None  # no text yet: the token waits for the next delta
    choice.add_text("c\ufffd", 1)
    assert choice.take_delta().text == "c"  # an incomplete character waits too
    choice.finish("length")
    delta = choice.take_delta()
    assert (delta.text, delta.num_tokens, delta.finish_reason) == ("\ufffd", 0, "length")


# ---- hand-off from the batcher thread ------------------------------------------------------


def test_one_wake_up_per_loop_for_a_step_of_many_requests():
    async def main():
        worker = WorkerHandoff()
        handoff = worker.for_loop(asyncio.get_running_loop())
        assert worker.for_loop(asyncio.get_running_loop()) is handoff
        collectors = [RequestOutputCollector() for _ in range(32)]

        def step(token):  # the batcher thread's step: one emit per request
            with worker.step():
                for i, collector in enumerate(collectors):
                    handoff.emit(collector, [(0, token + i, None, None, None)])

        for token in range(3):
            # the loop is free meanwhile: it could deliver between two emits, were they not held
            await asyncio.to_thread(step, token * 100)
            got = [await c.get() for c in collectors]
            assert got == [[(0, token * 100 + i, None, None, None)] for i in range(32)]
            assert handoff.wakeups == token + 1

    asyncio.run(main())


def test_a_failed_step_still_wakes_its_loops():
    async def main():
        worker = WorkerHandoff()
        handoff, collector = worker.for_loop(asyncio.get_running_loop()), RequestOutputCollector()

        def failing_step():
            with pytest.raises(RuntimeError), worker.step():
                handoff.emit(collector, [(0, 7, None, None, None)])
                raise RuntimeError("forward pass failed")
            handoff.emit(collector, RuntimeError("step failed"))  # outside a step: delivered as it comes

        await asyncio.to_thread(failing_step)
        assert await collector.get() == [(0, 7, None, None, None)]
        with pytest.raises(RuntimeError, match="step failed"):
            await collector.get()

    asyncio.run(main())


def test_a_lagging_consumer_takes_everything_pending_at_once_then_the_error():
    async def main():
        handoff = LoopHandoff(asyncio.get_running_loop())
        collector = RequestOutputCollector()

        def steps():
            for token in range(50):
                handoff.emit(collector, [(0, token, None, None, None)])
            handoff.emit(collector, RuntimeError("step failed"))

        thread = threading.Thread(target=steps)
        thread.start()
        thread.join()
        await asyncio.sleep(0)  # the delivery runs
        assert [item[1] for item in await collector.get()] == list(range(50))
        with pytest.raises(RuntimeError, match="step failed"):
            await collector.get()

    asyncio.run(main())


def test_a_closed_loop_drops_what_is_handed_to_it():
    loop = asyncio.new_event_loop()
    handoff = LoopHandoff(loop)
    loop.close()
    handoff.emit(RequestOutputCollector(), [(0, 1, None, None, None)])  # no error: nobody is left to read it
    handoff.emit(RequestOutputCollector(), [(0, 2, None, None, None)])
    assert handoff.wakeups == 2
