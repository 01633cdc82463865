"""arrays: where a JSON array's items end, and how many a newer array repeats."""

from __future__ import annotations

import json
import random

import msgspec

from sessionpin.reader import arrays


def test_where_an_arrays_items_end_whatever_its_white_space():
    """``arrays.item_ends`` against each item's place found by hand, for arrays laid out with any JSON
    white space (none, spaces, tabs, new lines; before and after commas, after ``[``, before
    ``]``) and from any item on. Seeded: the same run each time."""
    rnd = random.Random(7)
    for _ in range(300):
        values = [json.dumps({"role": "user", "content": "x" * rnd.randint(0, 5)} if rnd.random() < 0.5
                             else [rnd.randint(0, 9)], separators=(",", ":")).encode()
                  for _ in range(rnd.randint(0, 6))]
        space = (lambda: b"") if rnd.random() < 0.4 else (lambda: rnd.choice([b"", b" ", b"\n  ", b"\t", b"\r\n"]))
        array, places, starts = b"[", [], []
        for i, v in enumerate(values):
            if i:
                array += b","
            starts.append(len(array))               # just past the [ or the comma
            array += space()
            places.append(len(array) + len(v))
            array += v + space()
        array += b"]"
        for k in range(len(values)):
            items = msgspec.json.decode(b"[" + array[starts[k]:], type=list[msgspec.Raw])
            assert arrays.item_ends(array, items, starts[k]) == places[k:], (array, k)


def test_a_newer_array_repeats_all_or_all_but_the_last_item_or_none_by_one_compare():
    """``repeats`` against the count found item by item: all of the old items, all but the
    last (the cache mark moved), or 0 for anything else (an edit further back, a cut, another
    conversation). Seeded: the same run each time."""
    rnd = random.Random(3)
    for _ in range(500):
        old_items = [{"role": "user", "content": f"m{i} " + "x" * rnd.randint(0, 5)} for i in range(rnd.randint(0, 6))]
        new_items = [dict(m) for m in old_items]
        r = rnd.random()
        if r < 0.3 and new_items:
            new_items[-1]["content"] += " marked"                     # the last one changed
        elif r < 0.5 and new_items:
            new_items[rnd.randrange(len(new_items))]["content"] = "edited"
        elif r < 0.6 and new_items:
            del new_items[rnd.randrange(len(new_items)):]
        new_items += [{"role": "assistant", "content": "more"}] * rnd.randint(0, 3)
        sep = (",", ":") if rnd.random() < 0.7 else (", ", ": ")
        old, new = json.dumps(old_items, separators=sep).encode(), json.dumps(new_items, separators=sep).encode()
        ends = arrays.item_ends(old, msgspec.json.decode(old, type=list[msgspec.Raw]), 1)
        same = 0
        while same < min(len(old_items), len(new_items)) and old_items[same] == new_items[same]:
            same += 1
        expected = same if same >= len(old_items) - 1 and old_items else 0
        assert arrays.repeats(old, ends, new) == expected, (old, new)


def test_common_prefix_is_the_bytes_two_begin_with_alike_up_to_a_bound():
    rnd = random.Random(7)
    for _ in range(500):
        a = bytes(rnd.choice(b"ab") for _ in range(rnd.randint(0, 40)))
        b = a[:rnd.randint(0, len(a))] + bytes(rnd.choice(b"ab") for _ in range(rnd.randint(0, 10)))
        most = rnd.choice([None, rnd.randint(0, 50)])
        alike = 0
        while alike < min(len(a), len(b)) and a[alike] == b[alike]:
            alike += 1
        assert arrays.common_prefix(a, b, most) == (alike if most is None else min(alike, most)), (a, b, most)
