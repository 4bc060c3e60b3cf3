"""engines/prompt/reasoning.py: a thought split out of the answer, on whole texts and on every
split of a text into deltas (the streamed parts must add up to the whole split, thought words
never in either), reasoning tokens, thought words of templates, and `reasoning_effort`."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.errors import ServingError
from engines.prompt.reasoning import (
    ReasoningStreamer,
    ThoughtWords,
    split_reasoning,
    template_kwargs_for_effort,
    thought_words_for,
)
from engines.prompt.templates import get_template

THINK = ThoughtWords("<think>", "</think>")


@pytest.mark.parametrize("text, in_thought, reasoning, content", [
    ("<think>\nStep 1.\n</think>\n\nParis.", False, "Step 1.", "Paris."),  # qwen3's thought words
    ("  \n<think>a\n\nb</think>c", False, "a\n\nb", "c"),  # leading whitespace before the thought
    ("<think>\nStill thinking", False, "Still thinking", None),  # never closed: all reasoning
    ("<think>\n\n</think>\n\nParis.", False, None, "Paris."),  # an empty thought
    ("<think>\nDone.\n</think>\n\n", False, "Done.", None),  # nothing after the thought
    ("Paris.", False, None, "Paris."),  # no thought: the text as it is
    ("Paris <think>x</think>", False, None, "Paris <think>x</think>"),  # a thought only at the start
    ("", False, None, ""),
    ("Step 1.\n</think>\n\nParis.", True, "Step 1.", "Paris."),  # the prompt opened the thought
    ("Step 1.", True, "Step 1.", None),
    ("</think>Paris.", True, None, "Paris."),
])
def test_split_whole_texts(text, in_thought, reasoning, content):
    split = split_reasoning(text, THINK, in_thought)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_thought_words_of_templates():
    assert thought_words_for(get_template("qwen3"), None) == THINK  # the words' newlines are not matched
    assert thought_words_for(get_template("deepseekr1"), None) == THINK
    assert thought_words_for(get_template("seed_oss"), None) == ThoughtWords("<seed:think>", "</seed:think>")
    assert thought_words_for(get_template("qwen"), None) is None  # not a reasoning template
    assert thought_words_for(None, "{{ '<think>' }}{{ '</think>' }}") == THINK  # Jinja that marks thoughts
    assert thought_words_for(None, "{{ messages }}") is None
    assert thought_words_for(None, None) is None


def stream(text: str, cuts: list[int], in_thought: bool, words: ThoughtWords = THINK):
    """`text` fed to a streamer in pieces cut at `cuts`, each piece one token: (reasoning parts,
    content parts, reasoning tokens)."""
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    streamer = ReasoningStreamer(words, in_thought)
    reasoning, content = [], []
    for piece in pieces:
        r, c = streamer.feed(piece, 1)
        reasoning.append(r)
        content.append(c)
    r, c = streamer.finish()
    reasoning.append(r)
    content.append(c)
    return reasoning, content, streamer.reasoning_tokens, pieces


# Texts built from the pieces where a split goes wrong: thought words, their prefixes, newlines.
ATOMS = ["<think>", "</think>", "<thi", "</th", "<", "\n", "\n\n", " ", "a", "b c", "Paris.", "</", "<tool_call>"]
texts = st.lists(st.sampled_from(ATOMS), max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 80), max_size=10), in_thought=st.booleans())
def test_every_split_into_deltas_streams_the_whole_split(text, cuts, in_thought):
    cuts = [c for c in cuts if c < len(text)]
    whole = split_reasoning(text, THINK, in_thought)
    reasoning, content, tokens, pieces = stream(text, cuts, in_thought)
    assert "".join(reasoning) == (whole.reasoning or "")
    assert "".join(content) == (whole.content or "")
    # the thought words never leave as reasoning (an opening word inside a thought is its text)
    assert all("</think>" not in part for part in reasoning)
    if text.count("<think>") == 1 and not in_thought:
        assert all("<think>" not in part for part in reasoning)
    marks, chars = [], 0
    for k, piece in enumerate(pieces, 1):
        chars += len(piece)
        marks.append((chars, k))
    assert tokens == whole.reasoning_tokens(marks)


def test_reasoning_tokens_run_through_the_delta_that_closes_the_thought():
    pieces = ["<think>", "\nI", " think", "\n</", "think>\n\nPar", "is."]
    streamer = ReasoningStreamer(THINK)
    out = [streamer.feed(p, 1) for p in pieces]
    assert out[1:3] == [("I", ""), (" think", "")]
    assert out[3] == ("", "")  # a possible closing word and the newline before it are held back
    assert out[4] == ("", "Par")  # the thought ends in this delta: its tokens count as reasoning
    assert streamer.reasoning_tokens == 5
    assert streamer.finish() == ("", "")


def test_output_that_opens_no_thought_counts_no_reasoning_tokens():
    streamer = ReasoningStreamer(THINK)
    assert streamer.feed(" <th", 2) == ("", "")  # could still open a thought
    assert streamer.feed("ey", 1) == ("", " <they")
    assert streamer.reasoning_tokens == 0


def test_reasoning_effort_none_turns_thinking_off_where_the_template_can():
    assert template_kwargs_for_effort("none", {}, words=THINK, can_switch=True) == {"enable_thinking": False}
    for effort in (None, "low", "high", "xhigh"):  # no prompt changes
        assert template_kwargs_for_effort(effort, {"x": 1}, words=THINK, can_switch=True) == {"x": 1}
    assert template_kwargs_for_effort("none", {}, words=None, can_switch=False) == {}  # a model that never thinks
    with pytest.raises(ServingError) as err:
        template_kwargs_for_effort("none", {}, words=THINK, can_switch=False)
    assert err.value.param == "reasoning_effort"
    with pytest.raises(ServingError) as err:
        template_kwargs_for_effort("none", {"enable_thinking": True}, words=THINK, can_switch=True)
    assert err.value.param == "reasoning_effort"
