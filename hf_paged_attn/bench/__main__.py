"""``python -m hf_paged_attn.bench``: see :mod:`hf_paged_attn.bench.command`."""

from .command import main

if __name__ == "__main__":
    main()
