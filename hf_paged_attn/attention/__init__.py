"""What runs inside the model's forward: the step description, ``PagedAttentionCache``, the
attention function registered as ``"paged"`` and the model checks. Imports ``core`` and ``kernels``."""
