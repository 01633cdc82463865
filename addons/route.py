"""mitmdump -s addons/route.py: the sessionpin router."""
from sessionpin.addon import make_addons

addons = make_addons()
