"""One module per check (or family of checks), each listing its ``CHECKS`` (``registry.py``)."""
