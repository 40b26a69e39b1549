from pdd.http.stop_strings import StopStrings


def run(stops, deltas):
    s = StopStrings(stops)
    out = "".join(s.feed(d) for d in deltas)
    return (out if s.hit else out + s.flush()), s.hit


def test_no_stop_strings_pass_text_through():
    s = StopStrings([])
    assert s.feed("abc") == "abc" and s.flush() == "" and not s.hit


def test_stop_string_split_over_deltas_is_cut_and_not_released():
    text, hit = run(["\n\n"], ["Paris.", "\n", "\nThe", " answer"])
    assert hit and text == "Paris."


def test_held_tail_that_does_not_become_a_stop_is_released():
    s = StopStrings(["END"])
    assert s.feed("the EN") == "the "  # "EN" could start "END": held back
    assert s.feed("VOY") == "ENVOY"
    assert s.flush() == ""
    text, hit = run(["END"], ["the EN"])
    assert text == "the EN" and not hit  # the stream ended: the held tail is flushed


def test_earliest_of_several_stop_strings_wins():
    text, hit = run(["world", "lo"], ["hello world"])
    assert hit and text == "hel"


def test_nothing_is_released_after_a_stop():
    s = StopStrings(["x"])
    assert s.feed("abxcd") == "ab"
    assert s.feed("more") == "" and s.flush() == ""


def test_stop_at_the_very_start():
    assert run(["Q:"], ["Q", ": next"]) == ("", True)
