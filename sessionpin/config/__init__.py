"""The configuration: the TOML file read and validated into plain data (config), changed in
place with every other byte kept (configedit), and what looks like a key (redact).
"""
