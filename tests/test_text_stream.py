"""Streaming detokenization with stop strings, on a byte-level BPE tokenizer like the default model's."""
import pytest

from specee.text_stream import TextStream


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def stream_all(tokenizer, text, stop=()):
    stream = TextStream(tokenizer, stop)
    pieces = [stream.add([t]) for t in tokenizer.encode(text)]
    pieces.append(stream.finish())
    return pieces, stream


def test_streamed_pieces_join_to_the_decoded_text(tokenizer):
    text = "Héllo wörld — naïve café 😀 done."
    pieces, stream = stream_all(tokenizer, text)
    assert "".join(pieces) == text == stream.text
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_stop_string_cuts_the_text_and_is_never_shown(tokenizer):
    pieces, stream = stream_all(tokenizer, "alpha beta\n\ngamma delta", stop=["\n\n"])
    assert stream.stopped
    assert stream.text == "alpha beta"
    assert "".join(pieces) == "alpha beta"


def test_first_of_several_stop_strings_wins(tokenizer):
    _, stream = stream_all(tokenizer, "one two three four", stop=["four", "two"])
    assert stream.text == "one "
