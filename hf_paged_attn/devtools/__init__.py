"""Developer tooling, not the runtime: test helpers (``testing``), tiny configs of every
architecture (``tiny_configs``) and the compatibility-matrix generator (``compat``)."""
