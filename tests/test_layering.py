"""Import direction (docs/layout.md): a module may import its own layer and the layers below it, never one above."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvcompress"

# Lowest first; a module's layer is the longest matching prefix of its dotted name (without "kvcompress.").
LAYERS = [
    ("core", ("names", "decoding", "summary", "attention", "checks", "quantization", "ragged", "saved_state")),
    ("methods", ("methods", "scorers")),
    ("api", ("api", "options", "calibration")),
    ("model support", ("model_support",)),
    ("cache", ("cache", "cache_file")),
    ("integration", ("integration",)),
    ("eval", ("eval",)),
    ("cli", ("cli", "commands", "demo", "__main__")),
]
PACKAGE_ROOT = "__init__"  # kvcompress/__init__.py re-exports the public API (lazily for the integration)


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    if rank is None:
        raise AssertionError(f"kvcompress.{module} belongs to no layer: add it to LAYERS and docs/layout.md")
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, kvcompress-relative module) for every kvcompress import in a module's source, lazy ones included."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    tree = ast.parse(source)
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block) for n in ast.walk(block)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module and (node.module == "kvcompress" or node.module.startswith("kvcompress.")):
                target = node.module.removeprefix("kvcompress").lstrip(".")
            else:
                continue
            if target:
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:  # names taken from the package root: the modules its lazy exports load
                names = [_root_export(a.name) for a in node.names]
            out += [(node.lineno, n) for n in names if n]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvcompress."):
                    out.append((node.lineno, a.name.removeprefix("kvcompress.")))
                elif a.name == "kvcompress":  # the root: what each `alias.name` use of it loads
                    alias = a.asname or a.name
                    out += [(use.lineno, _root_export(use.attr)) for use in ast.walk(tree) if isinstance(use, ast.Attribute)
                            and isinstance(use.value, ast.Name) and use.value.id == alias]
    return out


def _root_export(name: str) -> str:
    """The kvcompress-relative module that `kvcompress.<name>` loads (the root's lazy `_EXPORTS`), or a submodule's name;
    "" for a dunder (`__version__` loads no module)."""
    import kvcompress

    if name.startswith("__"):
        return ""
    return kvcompress._EXPORTS.get(name, f"kvcompress.{name}").removeprefix("kvcompress").lstrip(".")


def _is_type_checking_block(node) -> bool:
    """`if TYPE_CHECKING:`: imports for annotations only, never run (they cannot make a circle)."""
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")


def all_modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_has_a_layer():
    for path in all_modules():
        module = module_name(path)
        if module != PACKAGE_ROOT:
            layer_of(module)


@pytest.mark.parametrize("path", all_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path):
    module = module_name(path)
    if module == PACKAGE_ROOT:
        return
    own = layer_of(module)
    upward = []
    for line, target in imports_of(path):
        if target and target != PACKAGE_ROOT and layer_of(target) > own:
            upward.append(f"line {line}: {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, f"kvcompress.{module} ({LAYERS[own][0]}) imports a higher layer: {upward}"


def test_library_modules_do_not_import_the_command_line():
    for path in all_modules():
        module = module_name(path)
        if module == PACKAGE_ROOT or LAYERS[layer_of(module)][0] == "cli":
            continue
        targets = [t for _, t in imports_of(path)]
        assert not any(t == "cli" or t.startswith(("cli.", "commands")) for t in targets), module


def upward_imports(source: str, module: str) -> list[str]:
    own = layer_of(module)
    return [t for _, t in imported_modules(source, module) if t != PACKAGE_ROOT and layer_of(t) > own]


def test_the_checker_sees_lazy_relative_and_absolute_upward_imports():
    source = "import torch\nfrom ..summary import KVSummary\n\ndef f():\n    from ..integration import generate\n    from kvcompress.cli import main\n    from . import base\n"
    assert upward_imports(source, "methods.probe") == ["integration", "cli"]
    assert upward_imports("from .. import cli\n", "eval.probe") == ["cli"]
    assert upward_imports("from kvcompress import generate, summary\n", "methods.probe") == ["integration"]
    assert upward_imports("from .. import load_model\n", "methods.probe") == ["integration"]
    assert upward_imports("import kvcompress as kvc\n\ndef f():\n    return kvc.compress, kvc.load_model()\n", "summary") \
        == ["api", "integration"]
    assert upward_imports("from ...api import compress\n", "eval.bench.probe") == []
    assert upward_imports("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cli import main\n", "methods.probe") == []


def import_graph() -> dict[str, set[str]]:
    """{module: the kvcompress modules it imports (lazy imports included)}, the package root left out."""
    graph = {}
    for path in all_modules():
        module = module_name(path)
        if module != PACKAGE_ROOT:
            graph[module] = {t for _, t in imports_of(path) if t and t != PACKAGE_ROOT and t != module}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle [a, b, ..., a] of the graph, or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph.get(root, ())))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_circle():
    """No kvcompress module reaches itself through the modules it imports, within a layer too. Counted: every import
    that runs, at module level or lazily inside a function (a lazy circle still ties two modules that need each other).
    Not counted: imports under `if TYPE_CHECKING:`, which never run (annotations only), and the package root
    `kvcompress/__init__.py` (it re-exports lazily)."""
    assert find_circle(import_graph()) is None, f"import circle: {' -> '.join(find_circle(import_graph()))}"


def test_the_circle_finder_finds_circles_and_only_circles():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


MAX_PARAMETERS = 12


def test_no_function_takes_more_than_twelve_parameters():
    """Every parameter counts (keyword-only, *args and **kwargs included), self and cls aside."""
    crowded = []
    for path in all_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p]
                count = len([n for n in names if n not in ("self", "cls")])
                if count > MAX_PARAMETERS:
                    crowded.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({count})")
    assert not crowded, crowded
