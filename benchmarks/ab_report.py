"""The report of an A/B benchmark whose two variants ran alternating in one process (``sampled_rows_ab.py``,
``lean_decode_ab.py``): each variant's runs and median, the ratio of the second's median to the first's with
each round's ratio, and how many requests got the same tokens from both."""

from __future__ import annotations

import statistics


def report(walls: dict[str, list[float]], tokens: dict[str, list[list[int]]], about: str) -> None:
    """``walls``: two variants' run times in seconds, in round order (the faster one expected first);
    ``tokens``: each variant's last output ids per request; ``about``: the workload, for the last line."""
    (first, firsts), (second, seconds) = walls.items()
    for name, runs in walls.items():
        print(f"{name:8s}: runs {', '.join(f'{w:.3f}' for w in runs)} s, median {statistics.median(runs):.3f} s")
    per_round = ", ".join(f"{b / a:.3f}" for a, b in zip(firsts, seconds))
    same = sum(a == b for a, b in zip(tokens[first], tokens[second]))
    ratio = statistics.median(seconds) / statistics.median(firsts)
    print(f"{second} / {first}: {ratio:.3f} (per round {per_round}); same tokens {same}/{len(tokens[first])}; {about}")
