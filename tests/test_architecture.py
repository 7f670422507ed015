"""The package's shape, as rules a change can break: which folder may import which, no import
cycle between modules or between folders, transformers' private API in one module only, torch's in another.

Every import counts, the ones inside functions too (a late import is still a dependency); only
``if TYPE_CHECKING:`` blocks are left out, since they never run.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_paged_attn"

# layer -> the layers it may import (besides itself). A layer is a folder of the package, or one
# of its root modules. Third-party rules are below.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "kernels": set(),
    "transformers_private": set(),
    "torch_private": set(),
    "attention": {"core", "kernels"},
    "runtime": {"core", "attention", "kernels", "transformers_private", "torch_private"},
    "parallel": {"runtime", "core", "attention", "kernels"},
    "integration": {"runtime", "parallel", "core", "attention", "kernels", "transformers_private", "torch_private"},
    # parallel: ``hf-paged-attn serve --tp-plan auto``'s other ranks; _env: the process defaults of a command
    "serve": {"public", "parallel", "_env"},
    "demo": {"public", "_env"},
    "_env": set(),
    "cli": {"public", "_env", "serve", "demo", "tools"},  # bench is a thin entry point into hf_paged_attn_tools
    "public": {"*"},  # hf_paged_attn/__init__.py: the public names
}
# What each layer may import from outside the package (None: anything).
THIRD_PARTY: dict[str, set[str] | None] = {
    "core": set(),
    "kernels": {"torch", "triton", "flash_attn"},
}
STDLIB = set(__import__("sys").stdlib_module_names)


def layer_of(module: str) -> str:
    """``hf_paged_attn.runtime.engine`` -> ``runtime``; ``hf_paged_attn`` -> ``public``."""
    if module.startswith("hf_paged_attn_tools"):
        return "tools"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "public"


def module_name(path: Path) -> str:
    if not path.is_relative_to(ROOT):
        return path.stem
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(
    path: Path, modules: set[str] | frozenset[str] = frozenset(), *, type_checking: bool = False
) -> set[str]:
    """Every module ``path`` imports, at any depth (functions included), resolved to absolute names;
    ``from X import name`` yields ``X.name`` (name may be a module) and ``X`` unless a name is one
    of ``modules``. ``type_checking``: count the imports under ``if TYPE_CHECKING:`` too."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = {f"{base}.{alias.name}" for alias in node.names}
            found.update(names)
            if not names & modules:  # ``from pkg import submodule`` depends on the submodule, not on pkg
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for root in (PACKAGE, ROOT / "hf_paged_attn_tools") for p in root.rglob("*.py")}


def internal_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        deps = {m for m in imports_of(path, set(modules), type_checking=type_checking) if m in modules and m != name}
        # a package's __init__ importing its own submodules is not a dependency worth naming
        graph[name] = {m for m in deps if not m.startswith(name + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, [*stack, nxt])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_cycle_between_modules():
    cycle = find_cycle(internal_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_modules_counting_type_hints():
    """A circle that only type hints close still ties the modules together for a reader and a refactor."""
    cycle = find_cycle(internal_graph(type_checking=True))
    assert cycle is None, "import cycle through TYPE_CHECKING imports: " + " -> ".join(cycle)


MAX_MODULES_PER_FOLDER = 14


def test_every_folder_holds_at_most_14_modules():
    """A folder of more modules than a reader holds in mind hides its parts: split it by concern."""
    bad = []
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            bad.append(f"{folder.relative_to(ROOT)}: {len(modules)} modules")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_layers():
    layers: dict[str, set[str]] = {}
    for module, deps in internal_graph().items():
        if layer_of(module) == "public":
            continue  # the package's front door imports every layer by design
        mine = layers.setdefault(layer_of(module), set())
        mine.update(layer_of(d) for d in deps if layer_of(d) not in (layer_of(module), "public"))
    cycle = find_cycle(layers)
    assert cycle is None, "layers import each other in a circle: " + " -> ".join(cycle)


def test_each_layer_imports_only_what_it_may():
    bad = []
    for module, deps in internal_graph().items():
        layer = layer_of(module)
        if layer == "tools":
            continue  # tooling may use anything of the package
        allowed = ALLOWED[layer]
        for dep in deps:
            other = layer_of(dep)
            if other == layer or "*" in allowed or other in allowed:
                continue
            if other == "public" and "public" in allowed:
                continue
            bad.append(f"{module} ({layer}) imports {dep} ({other})")
    assert not bad, "\n".join(sorted(bad))


def test_the_runtime_package_never_imports_the_tooling():
    bad = [
        f"{m} imports {d}"
        for m, deps in internal_graph().items()
        if m.startswith("hf_paged_attn.") and layer_of(m) != "cli"
        for d in deps
        if d.startswith("hf_paged_attn_tools")
    ]
    assert not bad, "\n".join(bad)


def test_third_party_imports_of_the_lower_layers():
    bad = []
    for module, path in package_modules().items():
        allowed = THIRD_PARTY.get(layer_of(module))
        if allowed is None:
            continue
        for dep in imports_of(path):
            top = dep.split(".")[0]
            if top in ("hf_paged_attn", "__future__") or top in STDLIB or top in allowed:
                continue
            bad.append(f"{module} imports {dep}")
    assert not bad, "\n".join(sorted(set(bad)))


def transformers_private_names() -> set[str]:
    """Private attributes of the transformers classes we touch (``_prepare_generation_config``,
    ``_eos_token_tensor``, ...): single-underscore names on GenerationMixin, PreTrainedModel,
    GenerationConfig (instance attributes included) and PreTrainedConfig."""
    names: set[str] = set()
    for cls in (transformers.GenerationMixin, transformers.PreTrainedModel, transformers.PreTrainedConfig):
        names.update(n for n, _ in inspect.getmembers(cls))
    config = transformers.GenerationConfig()
    names.update(dir(config))
    names.update(("_eos_token_tensor", "_pad_token_tensor", "_bos_token_tensor", "_decoder_start_token_tensor"))
    names.update(("_attn_implementation",))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_uses(path: Path, private: set[str]) -> list[str]:
    """``x._name`` for a private transformers name, on anything but ``self`` / ``cls``."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in private:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            uses.append(f"{path.name}:{node.lineno} .{node.attr}")
    return uses


def test_transformers_private_api_is_called_from_one_module():
    private = transformers_private_names()
    allowed = {PACKAGE / "transformers_private.py"}
    found = [u for p in PACKAGE.rglob("*.py") if p not in allowed for u in private_uses(p, private)]
    assert not found, "transformers' private API outside transformers_private.py:\n" + "\n".join(found)


def torch_private_uses(path: Path) -> list[str]:
    """``torch._name`` (``torch._dynamo``, ``torch._inductor``, ``torch._guards``, ...), ``torch.ops.mkldnn``,
    and imports of ``torch._*`` modules in ``path``."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                uses.append(f"{path.name}:{node.lineno} torch.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "mkldnn" and isinstance(node.value, ast.Attribute):
            if node.value.attr == "ops" and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch":
                uses.append(f"{path.name}:{node.lineno} torch.ops.mkldnn")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            uses.append(f"{path.name}:{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import):
            uses += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names if a.name.startswith("torch._")]
    return uses


def test_torch_private_api_is_called_from_one_module():
    allowed = {PACKAGE / "torch_private.py"}
    found = [u for p in PACKAGE.rglob("*.py") if p not in allowed for u in torch_private_uses(p)]
    assert not found, "torch's private API outside torch_private.py:\n" + "\n".join(found)


def test_the_rules_can_fail(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from hf_paged_attn.runtime import engine\n")
    assert "hf_paged_attn.runtime.engine" in imports_of(a)  # a late import counts
    a.write_text("if TYPE_CHECKING:\n    from hf_paged_attn.runtime import engine\n")
    assert not imports_of(a)
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    a.write_text("config._eos_token_tensor\nself._eos_token_tensor\n")
    assert len(private_uses(a, {"_eos_token_tensor"})) == 1
    a.write_text("import torch._dynamo\nfrom torch._guards import x\ntorch._inductor.config\ntorch.ops.mkldnn.f\n"
                 "torch.compile\ntorch.ops.aten.mm\n")
    assert len(torch_private_uses(a)) == 4


def test_tests_are_laid_out_like_the_package():
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    test_dirs = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert layers - {"demo", "assets"} <= test_dirs, f"no tests/ folder for {sorted(layers - test_dirs)}"
    assert test_dirs <= layers | {"e2e", "tools"}, f"tests/ folders with no layer: {sorted(test_dirs - layers)}"
