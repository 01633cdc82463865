"""What each answered turn used and cost: the server's usage read from the answer (usage),
the operator's prices (prices), the ledger kept in the store (ledger) and a turn's
OpenTelemetry GenAI attributes (genai).
"""
