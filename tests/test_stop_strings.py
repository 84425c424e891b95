"""Stop strings hold back only what could still become one: the longest end of the unreleased text
that begins a stop string. A long stop string no longer holds the whole stream to its end."""
from hypothesis import given, settings
from hypothesis import strategies as st

from specee.text_stream import TextStream

ALPHABET = "ab é\n"  # few letters: stop strings often match in part; "é" is two bytes


def partial_stop(text: str, stops: list[str]) -> int:
    """The longest end of `text` that is the start of a stop string, by brute force."""
    return max((size for size in range(1, len(text) + 1) for stop in stops
                if len(stop) > size and stop.startswith(text[-size:])), default=0)


class HoldingTheLongest(TextStream):
    """The rule before: hold back as many characters as the longest stop string has, less one."""

    def _partial_stop(self) -> int:
        return max(len(stop) for stop in self.stop) - 1


def streamed(stream: TextStream, tokens: list[int]) -> str:
    return "".join(stream.add([token]) for token in tokens) + stream.finish()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=8), min_size=1,
                                                              max_size=3))
def test_each_step_holds_back_only_a_possible_stop_and_the_output_is_the_text_cut_at_one(tiny_tokenizer, text, stops):
    stream = TextStream(tiny_tokenizer, stops)
    released = ""
    for token in tiny_tokenizer.encode(text):
        released += stream.add([token])
        assert stream.text.startswith(released)
        if not stream.stopped:
            assert len(stream.text) - len(released) == partial_stop(stream.text, stops)
    released += stream.finish()
    assert released == stream.text == streamed(HoldingTheLongest(tiny_tokenizer, stops), tiny_tokenizer.encode(text))


def test_a_long_stop_string_still_streams_every_token_at_once(tiny_tokenizer):
    text = "the cat sat on the mat and looked at the dog. " + "one two three four five six seven eight nine ten. " * 3
    stop = "the cat sat on the mat and " + "z" * 10_000  # begins like the text, and never ends it
    stream = TextStream(tiny_tokenizer, [stop])
    released, held = "", []
    for token in tiny_tokenizer.encode(text):
        released += stream.add([token])
        held.append(len(stream.text) - len(released))
    assert released == text and stream.finish() == ""
    # Held while the text could still be the stop string, until " looked" departs from it; from
    # then on at most a "the" that might begin it again, where the old rule held 10 kB to the end.
    departs = len(tiny_tokenizer.encode("the cat sat on the mat and looked"))
    assert held[departs - 2] == len("the cat sat on the mat and")
    assert max(held[departs:]) <= len("the") and held[-1] == 0


def test_a_long_stop_string_that_occurs_cuts_the_text_as_before(tiny_tokenizer):
    long_stop = "looked at the dog. " + "the cat sat on the mat and " * 300  # ~8 kB
    text = "one two three " + long_stop + "tail"
    stream = TextStream(tiny_tokenizer, [long_stop, "never"])
    pieces = [stream.add([token]) for token in tiny_tokenizer.encode(text)]
    assert stream.stopped and "".join(pieces) + stream.finish() == "one two three "
