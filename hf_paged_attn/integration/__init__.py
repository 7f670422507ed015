"""transformers glue: registers ``"paged"`` with transformers' interfaces and routes ``generate``
of paged models to the engine. Imports ``runtime``, ``parallel`` and below."""
