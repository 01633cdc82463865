"""mitmdump -s sessionpin/mitmscript/route.py: the sessionpin router (what `sessionpin run` loads)."""
from sessionpin.proxy import make_addons

addons = make_addons()
