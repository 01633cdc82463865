"""Lineage: what ties a request to the conversation it continues or forks, read from the
request's history (lineage, lineage_wire) and from the answer as it streams (lineage_stream).
"""
