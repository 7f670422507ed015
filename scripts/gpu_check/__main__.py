"""``python -m gpu_check`` (with ``scripts/`` on the path, as gpu_check.sh sets it), or
``python scripts/gpu_check``."""

import os
import sys

if not __package__:  # run as a folder: make it importable as the package it is
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_check.harness import main  # noqa: E402

sys.exit(main())
