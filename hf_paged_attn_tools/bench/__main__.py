"""``python -m hf_paged_attn_tools.bench``: see :mod:`hf_paged_attn_tools.bench.command`."""

from hf_paged_attn_tools.bench.command import main

if __name__ == "__main__":
    main()
