"""Text out of tokens: whole characters only, stop sequences found across token boundaries and never shown."""

from __future__ import annotations

import pytest

from peers.api.stops import IncrementalDecoder, StopMatcher, TextStream
from peers.model.tiny import make_byte_tokenizer


class Bytes:
    """Token i is byte i, decoded as UTF-8 with replacement (like a byte-level tokenizer)."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, text: str) -> tuple[str, bool]:
    shown = []
    for token in text.encode():
        piece, stopped = stream.push(token)
        shown.append(piece)
        if stopped:
            return "".join(shown), True
    rest, stopped = stream.finish()
    return "".join(shown) + rest, stopped


def test_multibyte_characters_are_held_until_complete():
    decoder = IncrementalDecoder(Bytes())
    pieces = [decoder.push(b) for b in "aé€".encode()]
    assert pieces == ["a", "", "é", "", "", "€"]


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement():
    decoder = IncrementalDecoder(Bytes())
    assert decoder.push(ord("a")) == "a"
    assert decoder.push(0xE2) == ""
    assert decoder.flush() == "\ufffd"


def test_the_window_decoding_equals_decoding_everything():
    tokenizer = make_byte_tokenizer()
    ids = tokenizer.encode("Grüße, ça va? 日本 ok").ids
    decoder = IncrementalDecoder(tokenizer)
    assert "".join(decoder.push(t) for t in ids) + decoder.flush() == tokenizer.decode(ids)


def test_a_stop_sequence_split_over_tokens_is_found_and_not_shown():
    assert feed(TextStream(Bytes(), ["END"]), "hello ENDworld") == ("hello ", True)


def test_a_partial_match_is_released_when_it_turns_out_not_to_be_a_stop():
    matcher = StopMatcher(["STOP"])
    assert matcher.push("ab ST") == ("ab ", False)
    assert matcher.push("OP?") == ("", True)
    matcher = StopMatcher(["STOP"])
    assert matcher.push("ab ST") == ("ab ", False)
    assert matcher.push("ay") == ("STay", False)


def test_the_earliest_of_several_stops_wins():
    assert feed(TextStream(Bytes(), ["world", "lo w"]), "hello world") == ("hel", True)


def test_held_text_is_flushed_at_the_end():
    assert feed(TextStream(Bytes(), ["\nUser:"]), "answer\nUs") == ("answer\nUs", False)


def test_a_stop_inside_one_token_text():
    matcher = StopMatcher(["</s>"])
    assert matcher.push("a</s>b") == ("a", True)


@pytest.mark.parametrize("text", ["", "plain", "naïve – 😀"])
def test_without_stops_everything_is_shown(text):
    assert feed(TextStream(Bytes()), text) == (text, False)
