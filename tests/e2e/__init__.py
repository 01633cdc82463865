"""End-to-end tests: a real mitmdump, real TLS, fake inference servers on loopback (see harness.py)."""
