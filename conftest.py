"""Test-session setup."""

import os

# No GPU here: Triton kernels can only run under its interpreter, and the interpreter must be
# chosen before the first `import triton` anywhere in the session (test order must not matter).
os.environ.setdefault("TRITON_INTERPRET", "1")
