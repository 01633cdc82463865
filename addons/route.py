"""mitmdump -s addons/route.py: the sessionpin router (see README and docs/router.md)."""
from sessionpin.proxy import make_addons

addons = make_addons()
