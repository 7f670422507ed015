"""Tooling around hf_paged_attn, not its runtime: the benchmarks (``bench``), test helpers
(``testing``), tiny configs of every architecture (``tiny_configs``), the compatibility-matrix
generator (``compat``) and the server launcher tests use (``launch``)."""
