"""The CPU compile stack: the inductor-compiled forward, its attention op, thread choices, packed and
float32 weight copies."""
