"""The package's shape: no import cycle between its modules, a slim engine."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_paged_attn"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports at run time (``if TYPE_CHECKING:`` blocks and
    imports inside functions, which run late, are left out)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}")
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("hf_paged_attn")}


def test_no_import_cycle_inside_the_package():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    # a package's __init__ importing its own submodules is not a cycle worth naming
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_cycle_finder_can_fail(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from hf_paged_attn import engine\n")
    assert "hf_paged_attn.engine" in imports_of_outside(a)
    b.write_text("if TYPE_CHECKING:\n    from hf_paged_attn import engine\n")
    assert not imports_of_outside(b)


def imports_of_outside(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_paged_attn"):
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_the_engine_reads_as_the_loop():
    lines = (PACKAGE / "engine.py").read_text().count("\n")
    assert lines <= 260, f"engine.py has {lines} lines; move what is not the loop into its own module"


def test_runtime_modules_are_not_dev_tooling():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert not root & {"testing", "tiny_configs", "compat"}, "dev tooling belongs in hf_paged_attn.devtools"
