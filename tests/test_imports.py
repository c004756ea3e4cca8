"""The qtensor modules import each other without cycles.

Every ``import`` / ``from ... import`` of a qtensor module is read with ``ast``, at module level
and inside functions alike: an import deferred into a function to dodge a cycle is still a cycle
(it only moves the failure to run time, and hides which module owns what). Nor does a module
set another one's globals (``dispatch.QTensor = QTensor``): a binding made later, by someone
else, is a cycle that the import graph does not show.
"""
import ast
import pathlib

import qtensor

ROOT = pathlib.Path(qtensor.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, modules) -> set:
    """The qtensor modules that the module ``name`` (at ``path``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from . import ops` imports the submodule qtensor.kernels.ops; `from . import quantize`
            # imports the package itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import qtensor.kernels.ops.x` -> qtensor.kernels.ops
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph):
    """One cycle through each strongly connected group of modules (Tarjan), as name lists."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_graph_sees_imports():
    # the parser must see the edges it is meant to check, or the acyclicity test cannot fail
    graph = _graph()
    assert "qtensor.kernels.ops" in graph["qtensor"]
    assert "qtensor.formats.block" in graph["qtensor.kernels.backend"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = _graph()
    cycles = _cycles(graph)
    detail = "\n".join(
        " <-> ".join(group) + ": " + "; ".join(
            f"{m} imports {', '.join(sorted(graph[m] & set(group)))}" for m in group)
        for group in cycles)
    assert not cycles, f"import cycles among qtensor modules:\n{detail}"



def _module_aliases(name: str, package: str, tree, modules) -> set:
    """The local names under which the module ``name`` binds other qtensor modules."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = ".".join(base[:len(base) - (node.level - 1)]
                            + ([node.module] if node.module else []))
            out.update(alias.asname or alias.name for alias in node.names
                       if f"{base}.{alias.name}" in modules)
        elif isinstance(node, ast.Import):
            out.update(alias.asname or alias.name.partition(".")[0] for alias in node.names
                       if alias.name.partition(".")[0] == "qtensor")
    return out


def _foreign_assignments(name: str, package: str, source: str, modules) -> list:
    """Assignments in module ``name`` to an attribute of another qtensor module."""
    tree = ast.parse(source)
    aliases = _module_aliases(name, package, tree, modules)
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found.extend(f"{name}:{node.lineno} sets {t.value.id}.{t.attr}" for t in targets
                     if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                     and t.value.id in aliases)
    return found


def test_no_module_binds_another_modules_globals():
    modules = _modules()
    # what tensor/subclass.py did before dispatch had register_qtensor: the check must see it
    late = "from . import dispatch as _dispatch\nclass QTensor: pass\n_dispatch.QTensor = QTensor\n"
    assert _foreign_assignments("qtensor.tensor.subclass", "qtensor.tensor", late, modules) == [
        "qtensor.tensor.subclass:3 sets _dispatch.QTensor"]
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found += _foreign_assignments(name, package, path.read_text(), modules)
    assert not found, "late bindings into other qtensor modules:\n" + "\n".join(found)


def _slots(source: str) -> list:
    """The module-level ``register_*(...)`` functions of a module that keep what they are given in
    the module (a global, or a module-level list or dict they add to): late-binding slots."""
    tree = ast.parse(source)
    top = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
           for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
           if isinstance(t, ast.Name)}
    found = []
    for f in tree.body:
        if not (isinstance(f, ast.FunctionDef) and f.name.startswith("register_") and f.args.args):
            continue  # (one without arguments registers something with torch: no slot)
        keeps = any(isinstance(n, ast.Global) for n in ast.walk(f)) or any(
            isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in top
            for n in ast.walk(f))
        if keeps:
            found.append(f.name)
    return found


# The slots that stay, each because the module that fills it sits above the one that calls it
# and the caller cannot be handed the dependency (see the comment at each):
_KNOWN_SLOTS = {
    # the classes' str/repr and BlockFormat's elem/scale given by name need the string form and
    # the parser, which need every class and the presets (formats/parse.py sits above them)
    "qtensor.formats.base": ["register_string_form"],
    # formats sit at the bottom; model.to(fmt) / t.to(fmt) is implemented by qtensor.nn.to_format
    "qtensor.formats.torch_function": ["register_to_handler"],
    # qt.convert's callers above nn (integrations/hf.py, and attention_hooks, which reads
    # convert's conversion table) add to every conversion
    "qtensor.nn.convert": ["register_model_hooks"],
}


def test_register_slots_are_only_the_known_ones():
    """Dependencies are passed explicitly (dispatch gets the QTensor class as an argument, FSDP2's
    hook travels with the converted module) instead of late-binding slots, but for the few listed
    in _KNOWN_SLOTS."""
    late = "_h = None\ndef register_qtensor(cls):\n    global _h\n    _h = cls\n"
    hooks = "_hooks = []\ndef register_hooks(a):\n    _hooks.append(a)\n"
    assert _slots(late) == ["register_qtensor"] and _slots(hooks) == ["register_hooks"]
    found = {name: _slots(path.read_text()) for name, path in _modules().items()}
    found = {name: slots for name, slots in found.items() if slots}
    assert found == _KNOWN_SLOTS


def _architecture_map():
    """The module names of docs/architecture.md's map (its first code block): `name.py` or
    `package/` first on a line, the line's indent (two spaces a level) placing it inside the
    last package line above it at the level before."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = text.split("```", 2)[1]
    named, stack = set(), []  # stack: the enclosing packages, one per indent level
    for line in block.splitlines():
        word = line.strip().split(" ", 1)[0]
        if not word:
            continue
        level = (len(line) - len(line.lstrip(" "))) // 2
        del stack[level:]
        if word.endswith("/") or word.endswith(".py"):
            named.add("".join(stack) + word)
        if word.endswith("/"):
            stack.append(word)
    return named


def test_architecture_map_names_every_module_and_only_modules():
    """docs/architecture.md is the one map of the package: every module is in it and every name
    in it is a module or package."""
    modules = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in ROOT.rglob("__init__.py")
                if p.parent != ROOT}
    named = _architecture_map()
    assert modules - named == set(), f"modules missing from docs/architecture.md: {modules - named}"
    assert named - modules - packages == set(), (
        f"docs/architecture.md names what does not exist: {named - modules - packages}")


def _package_of(module: str) -> str:
    """qtensor.kernels.gpu.blocks -> qtensor.kernels; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


def test_packages_form_layers():
    """The subpackages import each other without cycles too (formats, kernels, accum, tensor,
    nn, analysis, integrations, leaks, compat): each one only uses the ones below it."""
    graph = {}
    for name, deps in _graph().items():
        graph.setdefault(_package_of(name), set()).update(
            _package_of(d) for d in deps if _package_of(d) != _package_of(name))
    assert _cycles({"a.x": {"b.y"}, "b.y": set()}) == []
    cycles = _cycles(graph)
    assert not cycles, "import cycles among qtensor's packages:\n" + "\n".join(
        " <-> ".join(group) + ": " + "; ".join(
            f"{p} imports {', '.join(sorted(graph[p] & set(group)))}" for p in group)
        for group in cycles)
    assert graph["qtensor.formats"] <= set(), graph["qtensor.formats"]
    assert "qtensor.tensor" not in graph["qtensor.kernels"] | graph["qtensor.accum"]


def test_every_import_of_a_qtensor_module_resolves():
    """Each ``from <qtensor module> import name`` in the package names a module or something the
    module defines, also inside functions, where an import runs only when the code does; the old
    flat layout's module names stay importable for pickles only (qtensor/__init__.py), so
    ``from qtensor import ops`` must not be what the package itself uses."""
    import importlib
    bad = []
    for name, path in _modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                module = ".".join(base[:len(base) - (node.level - 1)]
                                  + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "qtensor":
                module = node.module
            else:
                continue
            if module.split(".")[1:2] and module.split(".")[1] in qtensor._FLAT_LAYOUT and \
                    f"qtensor.{module.split('.', 1)[1]}" not in _modules():
                bad.append(f"{name}:{node.lineno}: the flat layout's {module}")
                continue
            mod = importlib.import_module(module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(mod, alias.name) and \
                        f"{module}.{alias.name}" not in _modules():
                    bad.append(f"{name}:{node.lineno}: {module} has no {alias.name}")
    assert not bad, "imports that do not resolve:\n" + "\n".join(bad)


_KERNELS = "qtensor.kernels"


def _in_kernels(module: str) -> bool:
    return module == _KERNELS or module.startswith(_KERNELS + ".")


def _is_private(n: str) -> bool:
    return n.startswith("_") and not n.startswith("__")


def _dotted(node):
    """``a.b.c`` of a chain of attribute reads on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else None


def _kernel_private_uses(name: str, package: str, source: str, modules) -> list:
    """The private names (one leading underscore) of qtensor.kernels' modules that the module
    ``name`` outside the package imports or reads as attributes (``from ..kernels.ops import
    _x``, ``_ops._x``, ``qtensor.kernels.backend._x``); for a module inside it, the private
    names it imports from another module of the package: ``from .backend import _C`` makes
    ``ops._C`` a second way to reach it (read ``backend._C`` instead)."""
    tree = ast.parse(source)
    inside = _in_kernels(name)
    bound = {}  # local name -> the qtensor.kernels module it binds
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - (node.level - 1)]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not _in_kernels(base):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:  # a module (inside the package: its private ones too)
                    bound[alias.asname or alias.name] = full
                    if _is_private(alias.name) and not inside:
                        found.append(f"{name}:{node.lineno} imports {full}")
                elif _is_private(alias.name):
                    found.append(f"{name}:{node.lineno} imports {full}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _in_kernels(alias.name) and alias.asname:
                    bound[alias.asname] = alias.name
    if inside:
        return found
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        owner = _dotted(node.value)
        if owner is None:
            continue
        head, _, rest = owner.partition(".")
        module = bound.get(head, head) + (f".{rest}" if rest else "")
        if _in_kernels(module):
            found.append(f"{name}:{node.lineno} reads {module}.{node.attr}")
    return found


def test_no_module_reaches_the_kernels_private_names():
    # the private names of qtensor.kernels (its back end's tables and helpers, the extension
    # handle) are used inside the package only, and each is reached where it lives
    modules = _modules()
    before = ("from ..kernels import ops as _ops\nfrom ..kernels.ops import _round_scalar32\n"
              "import qtensor.kernels.backend as kb\nx = _ops._ROUNDING_CODE, kb._C\n"
              "y = qtensor.kernels.reference._f32\nfrom ..kernels.reference import _round_scalar\n"
              "z = _ops.quantize, kb.__name__\n")
    assert sorted(_kernel_private_uses("qtensor.tensor.dispatch", "qtensor.tensor", before,
                                       modules)) == [
        "qtensor.tensor.dispatch:2 imports qtensor.kernels.ops._round_scalar32",
        "qtensor.tensor.dispatch:4 reads qtensor.kernels.backend._C",
        "qtensor.tensor.dispatch:4 reads qtensor.kernels.ops._ROUNDING_CODE",
        "qtensor.tensor.dispatch:5 reads qtensor.kernels.reference._f32",
        "qtensor.tensor.dispatch:6 imports qtensor.kernels.reference._round_scalar"]
    reexport = "from .backend import (_C, _ROUNDING_CODE, op_args)\nfrom . import backend\nx = backend._C\n"
    assert _kernel_private_uses("qtensor.kernels.ops", "qtensor.kernels", reexport, modules) == [
        "qtensor.kernels.ops:1 imports qtensor.kernels.backend._C",
        "qtensor.kernels.ops:1 imports qtensor.kernels.backend._ROUNDING_CODE"]
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found += _kernel_private_uses(name, package, path.read_text(), modules)
    assert not found, ("private names of qtensor.kernels used outside it, or re-exported inside "
                       "it:\n" + "\n".join(found))
