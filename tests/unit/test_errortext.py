"""The caps on a failure's text (errands.errortext)."""

from __future__ import annotations

from errands.errortext import MESSAGE_LIMIT, TRACEBACK_LIMIT, clip, clip_lines, format_trace


def test_a_clipped_text_fits_its_limit_says_how_much_was_cut_and_clips_no_further() -> None:
    text = "a" * 100_000
    once = clip(text)
    assert len(once) <= MESSAGE_LIMIT
    kept = once.index("…")
    assert once.endswith(f"… ({100_000 - kept} more characters)")
    assert clip(once) == once
    assert clip("short") == "short"
    assert len(clip("b" * 50, 10)) <= 10


def test_a_traceback_keeps_its_frames_when_the_message_is_huge() -> None:
    def deep() -> None:
        raise ValueError("V" * 1_000_000)

    try:
        deep()
    except ValueError as exc:
        trace = format_trace(exc)
    assert len(trace) <= TRACEBACK_LIMIT + 4
    assert trace.startswith("Traceback (most recent call last)")
    assert "in deep" in trace
    assert "ValueError: VVV" in trace and "more characters)" in trace


def test_clipping_lines_keeps_short_ones_and_cuts_long_ones() -> None:
    text = "short line\n" + "L" * 5_000 + "\nlast"
    out = clip_lines(text, 100).split("\n")
    assert out[0] == "short line" and out[2] == "last"
    assert len(out[1]) <= 100 and out[1].endswith("more characters)")
