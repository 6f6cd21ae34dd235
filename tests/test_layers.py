"""The package's structure, read from its own import statements (those at
the top of a module and those inside functions alike): no import circle,
and no module importing from a layer above its own (docs/design.md, "The
path a call takes"): capture -> describe -> record -> the base modules;
live -> recover -> record. No module imports another's private names.

    python tests/test_layers.py    prints the drawing: each module and what it imports
"""

import ast
import os
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sglang_otel_kernels")
NAME = os.path.basename(PACKAGE)
# What each layer may import besides itself; the top (integrations/, __main__, the package's
# __init__, demo, example/, bootstrap/) may import any.
ALLOWED = {"base": set(), "record": {"base"}, "describe": {"record", "base"},
           "capture": {"describe", "record", "base"}, "recover": {"record", "base"},
           "live": {"recover", "record", "base"}}
# Module names that are not Python files of the package.
_COMPILED = {f"{NAME}._native"}


def modules() -> dict:
    """Dotted name -> path, of every module of the package."""
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path[:-3], os.path.dirname(PACKAGE)).replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(found: dict) -> dict:
    """Module -> {imported module of the package: (line, names taken)}."""
    known = set(found) | _COMPILED
    edges: dict = {}
    for module, path in found.items():
        with open(path) as handle:
            tree = ast.parse(handle.read())
        base = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else (node.module or "")
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    into = full if full in known else target
                    if into in known and into != module:
                        edges.setdefault(module, {})[into] = (node.lineno, [] if into == full else [alias.name])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known and alias.name != module:
                        edges.setdefault(module, {})[alias.name] = (node.lineno, [])
    return edges


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2:
        return parts[1] if parts[1] in ALLOWED else "top"
    return "top" if parts[-1] in (NAME, "__main__", "demo") else "base"


def circles(edges: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan's)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for other in edges.get(node, {}):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                other = stack.pop()
                on.discard(other)
                group.append(other)
                if other == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    assert circles(imports(modules())) == []


def test_no_module_imports_from_a_layer_above_its_own():
    climbing = [f"{module}:{line} imports {target}" for module, targets in imports(modules()).items()
                for target, (line, _) in targets.items()
                if layer(module) in ALLOWED and layer(target) not in ALLOWED[layer(module)] | {layer(module)}]
    assert climbing == []


def test_no_module_imports_anothers_private_names():
    taken = [f"{module}:{line} takes {name} from {target}" for module, targets in imports(modules()).items()
             for target, (line, names) in targets.items() for name in names
             if name.startswith("_") and not name.startswith("__")]
    assert taken == []


def test_the_layers_are_the_packages_folders():
    """A new folder gets its place in ALLOWED (and in docs/design.md), rather than passing unchecked."""
    folders = {name for name in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))}
    assert folders == set(ALLOWED) - {"base"} | {"integrations", "example", "bootstrap"}


if __name__ == "__main__":
    for module, targets in sorted(imports(modules()).items()):
        print(f"{module} ({layer(module)}) -> " + ", ".join(sorted(targets)))
    sys.exit(0)
