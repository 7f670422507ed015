"""The engine: its loop, executors, sampling, beam search, stats, device placement and cache
sizing. Imports ``core``, ``attention``, ``kernels`` and ``transformers_private``; never serving or
parallel code."""
