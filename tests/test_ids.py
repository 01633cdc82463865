"""ids: how session ids are shown, and found again from what a person typed."""

from __future__ import annotations

from sessionpin.reader import ids

FP = "fp:" + "3f" * 16


def test_short_forms():
    assert ids.short("1f0c9a2b-aaaa-4000-8000-000000000001") == "1f0c9a2b"
    assert ids.short("01a22a21-b93d-7021-a1a2-2b929ec0ac1a") == "9ec0ac1a"      # UUIDv7: its random end
    assert ids.short("ses_dd5df9b9fffebrWnqkZawdwcAw") == "ses_ZawdwcAw"
    assert ids.short(FP + ".a1b2c3d4") == "fp:3f3f3f3f" and ids.short(None) == "-"


def test_shorts_are_unique_among_the_ids_shown():
    """Two pi conversations that opened alike share a fingerprint (one nonce each): before
    issue 19 both read ``fp:3f3f3f3f`` in ``sessions``."""
    a, b, c = FP + ".a1b2c3d4", FP + ".a1b2ffff", "77e1d3c4-cccc-4000-8000-000000000003"
    got = ids.shorts([a, b, c, a])
    assert got == {a: "fp:3f3f3f3f…c3d4", b: "fp:3f3f3f3f…ffff", c: "77e1d3c4"}
    assert len(set(got.values())) == 3
    assert ids.matches(a, got[a]) and not ids.matches(b, got[a])
    d, e = FP + ".0000beef", FP + ".1111beef"          # the same last four: as many as tell them apart
    got = ids.shorts([d, e])
    assert got == {d: "fp:3f3f3f3f…0beef", e: "fp:3f3f3f3f…1beef"}


def test_an_id_nothing_shorter_tells_apart_is_shown_whole():
    got = ids.shorts(["abcdefgh1", "abcdefgh2"])
    assert got == {"abcdefgh1": "abcdefgh1", "abcdefgh2": "abcdefgh2"}


def test_an_id_pasted_from_a_refusal_to_pi_is_the_id():
    """A refusal to pi holds a word joiner inside digits pi's retry rule reads (answers.unnumbered):
    pasted back into the CLI, the id is the id."""
    from sessionpin.decision import answers
    session = "a5003f29-0000-4000-8000-000000000429"
    pasted = " " + answers.unnumbered(ids.short(session)) + "\n"
    assert pasted.strip() != ids.short(session)
    assert ids.typed(pasted) == ids.short(session) and ids.matches(session, ids.typed(pasted))
    assert ids.typed("  abc ") == "abc"
