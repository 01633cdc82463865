"""The request reader: an inference request's bytes in, its facts out (api, agent, session, turn),
and its prompt's shape. Pure: no store, no clock, no mitmproxy.
"""
