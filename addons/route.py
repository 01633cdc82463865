"""mitmdump -s addons/route.py: the sessionpin router.

This file alone is a correct start: besides the router it sets what the router needs
from mitmproxy (see docs/router.md):
- connection_strategy=lazy: connect upstream only after the router chose the server
  (with "eager", reverse mode connects to the original target before any hook).
"""
import logging

from mitmproxy import ctx

from sessionpin.addon import make_addons


class RouterDefaults:
    def configure(self, updated):
        if "connection_strategy" in updated and ctx.options.connection_strategy != "lazy":
            logging.getLogger("sessionpin.addon").info(
                "sessionpin: setting connection_strategy=lazy (the router chooses the upstream)")
            ctx.options.connection_strategy = "lazy"


addons = [RouterDefaults(), *make_addons()]
