"""The import graph of worker/, shared/, api/ and cli/, read with `ast` from the source: every
import counts as an edge, also one inside a function body or under `if TYPE_CHECKING:`.

- no import circle;
- the API never imports mlx (nor mlx_lm) or worker/, through any chain of imports;
- the client commands (cli/commands.py and what it imports, and cli/main.py's module-level
  imports) never import mlx or worker/: only `mtq worker` and `mtq make-model` do, from the
  functions that run those commands (cli/main.py imports them there for that reason).
"""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = ("worker", "shared", "api", "cli")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_graph(root: Path, packages=PACKAGES) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """(edges, module_level_edges, external): for each module, the project modules it imports
    (anywhere / at module level only), and the top-level names of the other packages it imports."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    module_level: dict[str, set[str]] = {m: set() for m in files}
    external: dict[str, set[str]] = {m: set() for m in files}

    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        in_functions = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: a relative import (this test reads absolute ones)"
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # `from pkg import module`
            else:
                continue
            for name in names:
                if name in files and name != module:
                    edges[module].add(name)
                    if id(node) not in in_functions:
                        module_level[module].add(name)
                elif name.split(".")[0] not in packages:
                    external[module].add(name.split(".")[0])
    return edges, module_level, external


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (circle := visit(n)):
                return circle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (circle := visit(m)):
            return circle
    return None


def reachable(edges: dict[str, set[str]], start: list[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += edges[m]
    return seen


def forbidden(edges, external, start: list[str]) -> list[str]:
    """Modules reachable from `start` that are worker/ modules or import mlx / mlx_lm."""
    return sorted(m for m in reachable(edges, start)
                  if m.split(".")[0] == "worker" or any(e.startswith("mlx") for e in external[m]))


GRAPH = read_graph(ROOT)


def test_no_import_circle():
    edges, _, _ = GRAPH
    assert find_circle(edges) is None, " -> ".join(find_circle(edges))


def test_the_api_imports_neither_mlx_nor_the_worker():
    edges, _, external = GRAPH
    api = [m for m in edges if m.split(".")[0] == "api"]
    assert forbidden(edges, external, api) == []


def test_the_client_commands_import_neither_mlx_nor_the_worker():
    edges, module_level, external = GRAPH
    # cli/main.py's own imports at module level, and the client commands with all they import.
    client = sorted(module_level["cli.main"] | {"cli.commands"})
    assert "cli.client" in reachable(edges, client)
    assert forbidden(edges, external, client) == []
    # ...while `mtq worker` and `mtq make-model` do reach the worker, from cli/main.py's functions.
    assert {"worker.supervisor.supervisor", "worker.runtime.make_model"} <= edges["cli.main"] - module_level["cli.main"]


def test_a_planted_circle_is_found_through_an_import_in_a_function(tmp_path):
    """The checks above must fail when what they guard breaks: a circle closed by an import
    hidden in a function body, and an API module that imports mlx through shared/."""
    for pkg, files in {
        "shared": {"a.py": "from shared import b\n", "b.py": "def f():\n    from shared.c import x\n",
                   "c.py": "import shared.a\nx = 1\n", "heavy.py": "import mlx.core as mx\n"},
        "api": {"routes.py": "from shared import heavy\n"}, "worker": {}, "cli": {},
    }.items():
        (tmp_path / pkg).mkdir()
        for name, text in {"__init__.py": "", **files}.items():
            (tmp_path / pkg / name).write_text(text)
    edges, module_level, external = read_graph(tmp_path)
    assert find_circle(edges) == ["shared.a", "shared.b", "shared.c", "shared.a"]
    assert find_circle(module_level) is None  # without the function's import there is none
    assert forbidden(edges, external, ["api.routes"]) == ["shared.heavy"]


# --------------------------------------------------------------------------- the supervisor

TRAINING_SIDE = ("worker.runtime", "worker.kinds", "worker.decode")
# The names by which the supervisor's side reaches code it never imports: rq's job functions
# and the training process's main (module, constant).
ENTRY_NAMES = (("shared.lifecycle", "RUN_JOB_FUNC"), ("worker.supervisor.gang_claims", "RANK_JOB_FUNC"),
               ("worker.supervisor.child", "TRAINING_MAIN"))


def on_training_side(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in TRAINING_SIDE)


def mlx_reached(edges, external, start: list[str]) -> list[str]:
    """Modules reachable from `start` that import mlx / mlx_lm, or are the training side's."""
    return sorted(m for m in reachable(edges, start)
                  if on_training_side(m) or any(e in ("mlx", "mlx_lm") for e in external[m]))


def module_path(root: Path, module: str) -> Path:
    path = root.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def string_constant(root: Path, module: str, name: str) -> str:
    """A module-level `NAME = "..."` of a module, read from its source."""
    tree = ast.parse(module_path(root, module).read_text())
    values = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)]
    assert len(values) == 1 and isinstance(values[0], str), (module, name)
    return values[0]


def names_a_function(root: Path, dotted: str) -> bool:
    """Whether `package.module.function` is a function defined at the top of that module."""
    module, _, function = dotted.rpartition(".")
    path = module_path(root, module)
    return path.is_file() and any(isinstance(node, ast.FunctionDef) and node.name == function
                                  for node in ast.parse(path.read_text()).body)


def test_the_supervisor_reaches_no_mlx_and_no_training_code():
    """`mtq worker`'s supervisor must always answer: none of its modules, nor any module they
    reach (function-level imports included), imports MLX or the training side."""
    edges, _, external = GRAPH
    supervisor = [m for m in edges if m.startswith("worker.supervisor.")]
    assert {"worker.supervisor.supervisor", "worker.supervisor.admission", "worker.supervisor.child"} <= set(supervisor)
    assert mlx_reached(edges, external, supervisor) == []


def test_the_names_that_cross_to_the_worker_are_functions_that_exist():
    """rq's job functions and the training process's main are named by strings (so that
    enqueuing and supervising never import them): each names a function that exists."""
    for module, constant in ENTRY_NAMES:
        name = string_constant(ROOT, module, constant)
        assert names_a_function(ROOT, name), f"{module}.{constant} = {name!r} names no function"
    assert on_training_side(string_constant(ROOT, "worker.supervisor.child", "TRAINING_MAIN"))


def test_a_planted_mlx_import_in_the_supervisor_is_found(tmp_path):
    """The checks above fail when what they guard breaks: a supervisor module that reaches
    mlx through an import in a function body, one that imports the training side, and an
    entry name whose function is gone."""
    for pkg, files in {
        "worker": {}, "worker/supervisor": {"a.py": "def f():\n    from shared import heavy\n",
                                            "b.py": "import worker.runtime.loop\n", "c.py": "ENTRY = 'worker.runtime.loop.gone'\n"},
        "worker/runtime": {"loop.py": "def main():\n    pass\n"},
        "shared": {"heavy.py": "import mlx_lm\n"}, "api": {}, "cli": {},
    }.items():
        (tmp_path / pkg).mkdir()
        for name, text in {"__init__.py": "", **files}.items():
            (tmp_path / pkg / name).write_text(text)
    edges, module_level, external = read_graph(tmp_path)
    assert mlx_reached(edges, external, ["worker.supervisor.a"]) == ["shared.heavy"]
    assert mlx_reached(module_level, external, ["worker.supervisor.a"]) == []  # only through the function's import
    assert mlx_reached(edges, external, ["worker.supervisor.b"]) == ["worker.runtime.loop"]
    assert names_a_function(tmp_path, "worker.runtime.loop.main")
    assert not names_a_function(tmp_path, string_constant(tmp_path, "worker.supervisor.c", "ENTRY"))
