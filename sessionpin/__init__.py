"""sessionpin: keep every running coding-agent conversation on the server it began on.

The package is a functional core (plain data in, decisions out) with one thin shell,
``sessionpin.addon``, the only module that imports mitmproxy.
"""

__version__ = "0.1.0"
