"""The decision: the request path as a stepper (route, its data in steps), the pin ladder
(ladder), the rewrite of a moved request (rewrite, headers' allowlists), the answers the
proxy gives itself (answers), and the body reader run on a process of its own (bodyreader).
"""
