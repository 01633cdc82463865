"""Offline readers: ``sessionpin classify`` (classify), the facts of saved requests, and the
requests of a mitmproxy flow file (flowfile, which imports mitmproxy when a file is read).
"""
