"""``--dry-run``: does every API a check calls still exist? Runs anywhere, no GPU, in seconds.

Two sources, per check:

- its module's imports (and those of ``helpers`` and ``base``, which every check uses), at any depth
  (the checks import the package inside their functions): each imported module is imported and
  each imported name looked up;
- its ``uses``: what imports do not show. ``"module:Qual.name"`` must resolve (a class attribute, a
  dataclass field, an annotation, or an attribute its ``__init__`` or another method assigns to
  ``self``); ``"module:Qual.name(p1, p2)"`` must also accept each named parameter explicitly (not
  through ``**kwargs``, which would swallow a renamed one).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

from .base import Check

# Imports a dry run resolves: the package, its tooling and what the checks drive. Optional kernels
# (triton, flash_attn) are reached through the package, which imports them itself.
RESOLVED_ROOTS = ("hf_paged_attn", "hf_paged_attn_tools", "transformers", "accelerate", "torch")
SHARED = ("helpers", "base")  # modules of this package every check uses


class _InstanceAttribute:
    """An attribute that exists on instances only (assigned in a method): nothing to look into."""


INSTANCE_ATTRIBUTE = _InstanceAttribute()


def imported_names(path: Path) -> list[tuple[str, str | None]]:
    """(module, name or None) for every absolute import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.module, alias.name) for alias in node.names]
    return [(m, n) for m, n in found if m.split(".")[0] in RESOLVED_ROOTS]


def check_import(module_name: str, name: str | None) -> str | None:
    """None when ``from module_name import name`` (or ``import module_name``) works, else why not."""
    try:
        module = importlib.import_module(module_name)
        if name is not None and not hasattr(module, name):
            importlib.import_module(f"{module_name}.{name}")  # a submodule
    except Exception as exc:
        what = module_name if name is None else f"{module_name}.{name}"
        return f"import {what}: {type(exc).__name__}: {exc}"
    return None


def attribute(owner: object, name: str) -> object:
    """``owner.name``, or ``INSTANCE_ATTRIBUTE`` for what instances of the class ``owner`` get in
    a method (``self.name = ...``); AttributeError when neither."""
    if hasattr(owner, name):
        return getattr(owner, name)
    if inspect.isclass(owner):
        if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
            return INSTANCE_ATTRIBUTE
        assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=[^=]")
        for klass in owner.__mro__:
            if name in getattr(klass, "__annotations__", {}):
                return INSTANCE_ATTRIBUTE
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            if assigned.search(source):
                return INSTANCE_ATTRIBUTE
    raise AttributeError(f"{getattr(owner, '__qualname__', owner)!r} has no attribute {name!r}")


def check_use(spec: str) -> str | None:
    """None when ``spec`` ("module:Qual.name" or "module:Qual.name(p1, p2)") resolves, else why not."""
    target, _, params = spec.partition("(")
    module_name, _, qualname = target.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in qualname.split("."):
            if obj is INSTANCE_ATTRIBUTE:
                raise AttributeError(f"cannot look inside an instance attribute for {part!r}")
            obj = attribute(obj, part)
    except Exception as exc:
        return f"{target}: {type(exc).__name__}: {exc}"
    wanted = [p.strip() for p in params.rstrip(")").split(",") if p.strip()]
    if not wanted:
        return None
    try:
        parameters = inspect.signature(obj).parameters
    except (TypeError, ValueError) as exc:
        return f"{target}: no signature ({exc})"
    named = {n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    missing = [p for p in wanted if p not in named]
    return f"{target}: no parameter {', '.join(missing)} in {list(parameters)}" if missing else None


def problems_of(check: Check, module_files: dict[str, Path]) -> tuple[int, list[str]]:
    """(how many names were resolved, what did not resolve) for one check."""
    names = []
    for module in (check.module, *(f"{_package()}.{m}" for m in SHARED)):
        names += imported_names(module_files[module])
    problems = [p for p in (check_import(m, n) for m, n in dict.fromkeys(names)) if p]
    problems += [p for p in (check_use(spec) for spec in check.uses) if p]
    return len(dict.fromkeys(names)) + len(check.uses), problems


def dry_run(checks: list[Check]) -> int:
    """One line per check: ``[OK]`` with how many APIs resolved, or ``[FAIL]`` with what did not.
    Returns the exit status (1 if any failed)."""
    files = {name: Path(module.__file__) for name, module in _modules(checks).items()}
    failed = 0
    for check in checks:
        count, problems = problems_of(check, files)
        if problems:
            failed += 1
            print(f"[FAIL] {check.name}: {len(problems)} of {count} APIs missing: {'; '.join(problems)}", flush=True)
        else:
            print(f"[OK] {check.name}: {count} APIs resolved ({check.module.rpartition('.')[2]})", flush=True)
    print(f"dry run: {len(checks) - failed} checks resolved, {failed} with missing APIs", flush=True)
    return 1 if failed else 0


def _package() -> str:
    return __name__.rpartition(".")[0]


def _modules(checks: list[Check]) -> dict[str, ModuleType]:
    names = {c.module for c in checks} | {f"{_package()}.{m}" for m in SHARED}
    return {name: sys.modules.get(name) or importlib.import_module(name) for name in names}
