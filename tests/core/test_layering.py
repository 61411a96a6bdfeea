"""The package structure (docs/DESIGN.md §1.1), read from the source with `ast`: which package may import which, that
the import graph between packages has no cycle, and that each integration owns its format."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# import name -> directory (dart_converters lives in converters/, pyproject.toml's package-dir)
PACKAGES = {"dart_runtime": "dart_runtime", "dart_core": "dart_core", "dart_hf": "dart_hf", "dart_sglang": "dart_sglang",
            "dart_converters": "converters", "dart_train": "dart_train", "dart_bench": "dart_bench",
            "dart_cli": "dart_cli"}
# what each package may import (directly or inside functions): the layers of docs/DESIGN.md §1.1
# dart_runtime (platform code: kernels, CUDA graphs, device sync) is the bottom layer; dart_core keeps DART's
# decisions and no test oracle (those live in dart_bench, with the tests and benchmarks that use them)
ALLOWED = {
    "dart_runtime": set(),
    "dart_core": {"dart_runtime"},
    "dart_converters": {"dart_core"},
    "dart_hf": {"dart_core", "dart_runtime"},
    "dart_sglang": {"dart_core", "dart_runtime", "dart_converters"},
    "dart_train": {"dart_core", "dart_runtime", "dart_hf"},
    "dart_bench": {"dart_core", "dart_runtime", "dart_hf"},
    "dart_cli": {"dart_core", "dart_runtime", "dart_converters", "dart_hf", "dart_sglang", "dart_train", "dart_bench"},
}
SGLANG_ARCHITECTURE_MODULE = "dart_sglang/head_format.py"


def modules(package: str) -> dict[str, ast.Module]:
    """Dotted module name -> parsed source, for every module of `package`."""
    base = ROOT / PACKAGES[package]
    out = {}
    for file in sorted(base.rglob("*.py")):
        parts = list(file.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = ast.parse(file.read_text(), str(file))
    return out


def imported(module: str, tree: ast.Module, is_package: bool) -> set[str]:
    """Every module name `tree` imports, anywhere in it (function-level imports included), relative ones resolved."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            names.add(name)
            names.update(f"{name}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def package_imports() -> dict[str, set[str]]:
    """package -> the other project packages it imports."""
    graph = {}
    for package in PACKAGES:
        deps = set()
        for module, tree in modules(package).items():
            is_package = (ROOT / PACKAGES[package] / "/".join(module.split(".")[1:]) / "__init__.py").is_file()
            deps |= {name.split(".")[0] for name in imported(module, tree, is_package)}
        graph[package] = (deps & set(PACKAGES)) - {package}
    return graph


def test_each_package_imports_only_the_layers_below_it():
    graph = package_imports()
    extra = {p: sorted(deps - ALLOWED[p]) for p, deps in graph.items() if deps - ALLOWED[p]}
    assert not extra, f"imports outside the layering: {extra}"


def test_the_package_import_graph_has_no_cycle():
    graph = package_imports()
    done, active = set(), []

    def visit(package):
        if package in active:
            pytest.fail("import cycle: " + " -> ".join(active[active.index(package):] + [package]))
        if package in done:
            return
        active.append(package)
        for dep in sorted(graph[package]):
            visit(dep)
        active.pop()
        done.add(package)

    for package in graph:
        visit(package)


def test_the_core_and_the_sglang_format_import_no_framework():
    for module, tree in modules("dart_core").items():
        frameworks = {n.split(".")[0] for n in imported(module, tree, False)} & {"transformers", "sglang"}
        assert not frameworks, f"{module} imports {frameworks}"
    # at run time, through every module they pull in: what `dart-spec convert sglang`/`serve` and SGLang's plugin
    # loader (every SGLang process) import
    code = ("import sys, dart_sglang, dart_sglang.head_format, dart_sglang.settings, dart_sglang.sampling, "
            "dart_cli.main; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'transformers')); "
            "assert not bad, bad[:5]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def constants(tree: ast.Module) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_each_format_name_is_spelled_in_one_module():
    from dart_sglang.head_format import CONFIG_BLOCK, SGLANG_ARCHITECTURE

    spelled = {}
    for package in PACKAGES:
        for module, tree in modules(package).items():
            for name in {SGLANG_ARCHITECTURE, CONFIG_BLOCK} & set(constants(tree)):
                spelled.setdefault(name, []).append(module)
    assert spelled == {SGLANG_ARCHITECTURE: ["dart_sglang.head_format"], CONFIG_BLOCK: ["dart_sglang.head_format"]}
    # SGLang's registry matches the architecture to the draft model class by its name
    model = modules("dart_sglang")["dart_sglang.models.llama_dart"]
    entry = next(n for n in model.body if isinstance(n, ast.Assign) and n.targets[0].id == "EntryClass")
    assert [e.id for e in entry.value.elts] == [SGLANG_ARCHITECTURE]


def test_no_isinstance_on_head_classes_outside_the_drafters():
    """What differs between drafters lives behind the drafter interface (`DartHead.draft` / `build_tree` /
    `training_forward`), not in isinstance branches of its callers; `isinstance(x, DartHead)` (is it a drafter at
    all) stays allowed."""
    from dart_core import DartHead

    heads, todo = set(), [DartHead]
    while todo:
        cls = todo.pop()
        heads |= {sub.__name__ for sub in cls.__subclasses__()}
        todo += cls.__subclasses__()
    assert "Eagle3Head" in heads
    found = []
    for package in PACKAGES:
        for module, tree in modules(package).items():
            if module in ("dart_core.head", "dart_core.eagle3"):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                    names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", None)
                             for n in ast.walk(node.args[1])}
                    if names & heads:
                        found.append(f"{module}:{node.lineno}")
    assert not found, found
