"""The one sanitiser for tool results: no terminal control sequence survives, text does."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipyfence.sanitize import clean

# What may never reach a client: every C0 control but \t and \n, DEL, and every C1 control.
FORBIDDEN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def assert_safe(text: str) -> None:
    bad = FORBIDDEN.search(text)
    assert bad is None, f"control {bad.group()!r} survived in {text!r}"


HOSTILE = {
    "osc52 clipboard, BEL": ("a\x1b]52;c;ZWNobyBwd25lZA==\x07b", "ab"),
    "osc52 clipboard, ST": ("a\x1b]52;c;ZWNobyBwd25lZA==\x1b\\b", "ab"),
    "osc8 hyperlink": ("\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\", "click"),
    "osc title": ("\x1b]0;pwned\x07ok", "ok"),
    "csi clear screen": ("\x1b[2J\x1b[Hok", "ok"),
    "csi private": ("\x1b[?1049h\x1b[?25lok", "ok"),
    "csi intermediate": ("\x1b[1 qok", "ok"),
    "csi sgr": ("\x1b[38;2;255;0;0mred\x1b[0m", "red"),
    "dcs": ("\x1bP1$r0m\x1b\\ok", "ok"),
    "apc": ("\x1b_Gf=100;AAAA\x1b\\ok", "ok"),
    "pm": ("\x1b^secret\x1b\\ok", "ok"),
    "sos": ("\x1bXsecret\x1b\\ok", "ok"),
    "two-byte reset": ("\x1bcok", "ok"),
    "charset": ("\x1b(0ok\x1b(B", "ok"),
    "save cursor": ("\x1b7ok\x1b8", "ok"),
    "c1 csi": ("\x9b2J\x9b31mok", "ok"),
    "c1 osc": ("\x9d52;c;aGk=\x9cok", "ok"),
    "c1 osc bel": ("\x9d0;t\x07ok", "ok"),
    "c1 dcs": ("\x90q#0\x9cok", "ok"),
    "c1 bare": ("a\x85b\x8dc\x9fd", "abcd"),
    "lone esc": ("a\x1b", "a"),
    "bel backspace nul del": ("a\x07\x08\x00\x7fb", "ab"),
    "vt ff": ("a\x0b\x0cb", "ab"),
    "nested esc": ("\x1b\x1b[31mok", "ok"),
    "unterminated osc keeps later lines": ("\x1b]52;c;AAAA\n[ipyfence: note]\n", "52;c;AAAA\n[ipyfence: note]\n"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_corpus(name: str) -> None:
    text, expected = HOSTILE[name]
    assert clean(text) == expected
    assert_safe(clean(text))


def test_ordinary_text_newlines_tabs_and_unicode_survive() -> None:
    text = "col1\tcol2\nÄ ü — 日本語 🐍\n\n  indented\n"
    assert clean(text) == text


def test_crlf_becomes_lf() -> None:
    assert clean("a\r\nb\r\n") == "a\nb\n"


def test_carriage_return_keeps_what_the_terminal_finally_shows() -> None:
    bar = "".join(f"\r{p:3d}%" for p in range(0, 101, 10))
    assert clean(f"before\n{bar}\nafter\n") == "before\n100%\nafter\n"
    assert clean("abc\r") == "abc"  # a bare \r erases nothing
    assert clean("line1\nline2\rLINE2") == "line1\nLINE2"  # earlier lines are kept
    assert clean("x\r\r\n") == "x\n"


def test_clean_is_idempotent_on_its_output() -> None:
    text = "\x1b[31mred\x1b[0m\r\nok\rOK\x9b2J"
    assert clean(clean(text)) == clean(text)


_INTRODUCERS = ["\x1b", "\x1b[", "\x1b]", "\x1bP", "\x1b_", "\x1b^", "\x1bX", "\x9b", "\x9d", "\x90", "\x9c", "\x07"]


@given(st.lists(st.one_of(st.sampled_from(_INTRODUCERS), st.text(max_size=8)), max_size=30))
def test_no_control_survives_any_mix(parts: list[str]) -> None:
    out = clean("".join(parts))
    assert_safe(out)
    assert "\r" not in out


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc",)), max_size=200))
def test_text_without_controls_is_unchanged(text: str) -> None:
    assert clean(text) == text


@given(st.text(max_size=200))
def test_any_text_is_safe(text: str) -> None:
    assert_safe(clean(text))


def test_cleaning_stays_linear_on_unterminated_introducers() -> None:
    # A failed match must not rescan the rest of the line from every introducer (quadratic):
    # two million introducers would otherwise take hours. This only has to finish.
    for text in ("\x9d" * 2_000_000, "\x1b]" * 1_000_000, ("\x9b" + "0" * 50) * 40_000):
        assert FORBIDDEN.search(clean(text)) is None
