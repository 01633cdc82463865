"""sessionpin: keep every running coding-agent conversation on the server it began on.

The package is a functional core (plain data in, decisions out) with one thin shell,
``sessionpin.proxy``, the only package that imports mitmproxy (docs/design.md).
"""

__version__ = "0.1.0"
