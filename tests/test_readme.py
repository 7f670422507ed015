"""The README's Quickstart code blocks run as written (a user's first copy-paste must work)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_blocks() -> list[str]:
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_quickstart_runs(capsys):
    blocks = quickstart_blocks()
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    out = namespace["out"]
    assert out.shape[0] == len(namespace["prompts"])
    lengths = [len(r.output_ids) for r in namespace["results"]]
    assert len(lengths) == 3 and all(0 < n <= limit for n, limit in zip(lengths, [16, 32, 8]))
    assert "The for statement" in capsys.readouterr().out
