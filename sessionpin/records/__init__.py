"""Records kept in the store: pins (pins), the lineage index (lineindex), the documents a
proxy publishes (documents), and the pins this proxy served, held in memory (served).
"""
