"""``python -m hf_paged_attn.serve MODEL ...``: see :mod:`hf_paged_attn.serve.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
