"""Server pools (docs/serverpools.md): which member a new conversation goes to (allocate, pure),
what servers' answers say about their quota (quota, pure), and the pools' records in the
store (members).
"""
