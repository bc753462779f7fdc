"""No two modules of course_lib import each other, directly or around a loop (module-level and
function-level imports alike): a value both sides need belongs in the lower module
(docs/ARCHITECTURE.md, "Layers run one way"). A package's __init__ handing on its own children
does not count."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "course_lib"


def import_graph() -> dict[str, set[str]]:
    """module -> the course_lib modules it imports (resolved to modules that exist)."""
    root = PACKAGE.parent
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1 packages
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                own_child = path.name == "__init__.py" and t.startswith(mod + ".")
                if t and t != mod and not own_child:
                    graph[mod].add(t)
    return graph


def test_no_module_of_course_lib_imports_itself_back():
    graph = import_graph()
    assert "course_lib.train_config" in graph and graph["course_lib.train_config"], "the graph is empty: parser broken"
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "import cycles (move what both sides use into the lower module):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The graph builder finds a planted loop (so the test above can fail)."""
    pkg = tmp_path / "course_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train_config.py").write_text("from course_lib import b\n")
    (pkg / "b.py").write_text("def f():\n    from course_lib.train_config import x\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    graph = import_graph()
    assert "course_lib.b" in graph["course_lib.train_config"] and graph["course_lib.b"] == {"course_lib.train_config"}


def test_only_the_notebooks_and_the_grader_import_the_labs_package():
    """Mechanism packages (parallel/, checkpoint/, stability/, estimate/, the trainer...) never lean
    on notebook scaffolding: course_lib.labs is imported only by itself and by course_lib.grading."""
    graph = import_graph()
    assert "course_lib.labs.exercise_harness" in graph, "the labs package moved: update this test"
    leaning = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() for dep in deps
                     if dep.startswith("course_lib.labs") and not mod.startswith(("course_lib.labs", "course_lib.grading")))
    assert not leaning, "library modules import notebook scaffolding:\n" + "\n".join(leaning)
