"""served.Served: the bounded memory of pins this proxy served (issue 18, partial loss)."""

from sessionpin.records.served import Served


def test_a_served_pin_is_expected_until_it_expires():
    s = Served()
    s.saw("a", "glm", expires=100.0, now=10.0)
    assert s.expected("a", 50.0) == ("glm", 100.0, 10.0)
    assert s.expected("b", 50.0) is None                # never served: not watched
    assert s.expected("a", 100.0) is None               # expired: not a loss
    assert s.expected("a", 50.0) is None                # and forgotten


def test_the_bound_drops_the_least_recently_served():
    s = Served(bound=2)
    s.saw("a", "glm", 100.0, 1.0)
    s.saw("b", "glm", 100.0, 1.0)
    s.saw("a", "glm", 100.0, 2.0)                       # served again: most recent
    s.saw("c", "glm", 100.0, 3.0)
    assert len(s) == 2
    assert s.expected("b", 5.0) is None
    assert s.expected("a", 5.0) and s.expected("c", 5.0)


def test_a_tombstone_made_after_the_serving_is_the_operators():
    s = Served()
    s.saw("a", "glm", 100.0, now=10.0)
    assert not s.forgotten("a", None)
    assert not s.forgotten("a", "5.0")                  # forgotten before this pin was served: a loss
    assert s.expected("a", 20.0)
    assert s.forgotten("a", "12.5")
    assert s.expected("a", 20.0) is None
    s.saw("b", "glm", 100.0, now=10.0)
    assert s.forgotten("b", "garbage")                  # a tombstone we cannot date: the operator's


def test_a_tombstone_naming_the_pin_served_is_the_operators_whatever_the_clocks():
    """The operator's machine runs behind the proxy's: its tombstone's time is before the
    proxy last served the pin, but it names that very pin (its ``since``): forgotten, not a
    loss (before: a 424 store-lost for a conversation the operator had just released). A pin
    made after the one forgotten is still a loss."""
    s = Served()
    s.saw("a", "glm", 2000.0, now=500.0, since=50.0)
    assert s.forgotten("a", '{"at":100.0,"since":50.0,"expires":2000.0}')
    s.saw("b", "glm", 3000.0, now=500.0, since=60.0)
    assert not s.forgotten("b", '{"at":900.0,"since":50.0,"expires":2000.0}')
    assert s.expected("b", 600.0)


def test_each_loss_is_reported_once_and_clear_forgets_everything():
    s = Served()
    s.saw("a", "glm", 100.0, 1.0)
    assert s.report("a") and not s.report("a")
    s.saw("a", "glm", 100.0, 2.0)                       # served again (restored): a new loss is new
    assert s.report("a")
    s.clear()
    assert len(s) == 0 and s.expected("a", 5.0) is None
