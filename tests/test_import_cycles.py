"""No two modules of course_lib import each other, directly or around a loop (module-level and
function-level imports alike): a value both sides need belongs in the lower module
(docs/ARCHITECTURE.md, "Layers run one way"). A package's __init__ handing on its own children
does not count. Between the library's folders, imports run one way only (LAYERS), and the tree
itself reads like the course map: folders, and at the top only the modules many chapters share."""
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
    assert "course_lib.trainer.config" in graph and graph["course_lib.trainer.config"], "the graph is empty: parser broken"
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


#: course_lib's top-level folders and modules, lowest first; a module may import its own folder, a
#: folder on its own level or one below it, never one above (docs/ARCHITECTURE.md, "Layers run one way").
LAYERS = [
    {"validate", "estimate"},                                  # torch-free arithmetic and checks
    {"model", "data", "precision", "schedules", "measure"},
    {"stability", "checkpoint", "watch"},
    {"parallel"},
    {"trainer"},
    {"train"},
    {"planner", "launchers", "grading", "kit", "labs", "ckpt"},  # front doors and notebook plumbing
    {"cli"},
]
TOP_MODULES = {"__init__.py", "cli.py", "train.py", "precision.py", "schedules.py", "measure.py", "validate.py"}


def _layer_of(module: str) -> int | None:
    top = module.split(".")[1] if module.count(".") else None
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'mod -> dep' for every import from a lower folder into a higher one."""
    found = []
    for mod, deps in graph.items():
        for dep in deps:
            low, high = _layer_of(mod), _layer_of(dep)
            if low is not None and high is not None and high > low:
                found.append(f"{mod} (layer {low}) -> {dep} (layer {high})")
    return sorted(found)


def test_every_folder_and_top_module_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in import_graph() if m.count(".") and _layer_of(m) is None})
    assert not unplaced, f"add these to LAYERS in tests/test_import_cycles.py (and docs/ARCHITECTURE.md): {unplaced}"


def test_no_import_runs_back_up_the_layers():
    found = upward_imports(import_graph())
    assert not found, ("a lower layer imports a higher one; move what both need into the lower one:\n"
                       + "\n".join(found))


def test_the_layer_check_sees_an_upward_import():
    graph = {"course_lib.parallel.strategy": {"course_lib.trainer.config"}, "course_lib.trainer.config": set()}
    assert upward_imports(graph) == ["course_lib.parallel.strategy (layer 3) -> course_lib.trainer.config (layer 4)"]


def test_the_top_level_holds_folders_and_the_shared_modules_only():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in TOP_MODULES)
    assert not loose, f"modules at the top of course_lib/ that belong in a folder: {loose}"


def repeats_its_folder(path: Path) -> bool:
    """trainer/train_config.py, model/model.py, ranks/rank_entry.py: the name's first word is (the
    start of) its folder's name."""
    word = path.stem.split("_")[0]
    return path.stem != "__init__" and len(word) >= 3 and path.parent.name.startswith(word)


def test_no_file_repeats_its_folders_name():
    assert [repeats_its_folder(Path(p)) for p in ("trainer/train_config.py", "ranks/rank_entry.py",
                                                  "watch/watchdog.py", "trainer/config.py")] == [True, True, False, False]
    repeats = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.parent != PACKAGE and repeats_its_folder(p))
    assert not repeats, f"files named after their own folder (drop the prefix): {repeats}"
