"""The engine's bookkeeping in plain Python (no torch, no transformers): requests and their
intake, the block allocator, the KV-block manager, the scheduler and its policies, attention
groups. Imports only itself and the standard library."""
