"""The script ``sessionpin run`` gives mitmdump (``-s .../sessionpin/mitmscript/route.py``).

It lives in the package so an installed sessionpin can start its router without the
repository's ``addons/route.py``; it sits in a folder of its own because mitmdump puts a
script's folder on ``sys.path`` while loading it.
"""
