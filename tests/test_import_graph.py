"""The import graph of worker/, shared/, api/ and cli/, read with `ast` from the source: every
import counts as an edge, also one inside a function body or under `if TYPE_CHECKING:`.

- no import circle;
- the API never imports mlx (nor mlx_lm) or worker/, through any chain of imports;
- the client commands (cli/commands.py, cli/mcp_server.py and what they import, and
  cli/main.py's module-level imports) never import mlx or worker/: only `mtq worker` and
  `mtq make-model` do, from the functions that run those commands (cli/main.py imports them
  there for that reason);
- no supervised kind, nor model loading or the memory plan, reaches the decode package;
- the supervisor package reaches neither mlx nor the training side (runtime, kinds, decode):
  it names rq's job functions and the training process's main by strings, which must exist.
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
    # cli/main.py's own imports at module level, and the client commands (`mtq mcp` too) with all they import.
    client = sorted(module_level["cli.main"] | {"cli.commands", "cli.mcp_server"})
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


DECODING_KINDS = ("worker.kinds.grpo", "worker.kinds.grpo_job", "worker.kinds.session_job",  # the kinds that sample
                  "worker.kinds.rloo", "worker.kinds.reinforce", "worker.kinds.online_dpo",
                  "worker.kinds.ppo", "worker.kinds.gkd_job")
LOADING = ("worker.runtime.models", "worker.runtime.memory_plan")  # what every kind loads a model with


def import_chain(edges: dict[str, set[str]], start: str, target: str) -> list[str] | None:
    """The shortest chain of imports from `start` to `target` or a module under it, or None:
    every import counts (one in a function too), and importing a module also runs its packages'
    __init__ first."""
    came_from = {start: None}
    todo = [start]
    for m in todo:
        if m == target or m.startswith(target + "."):
            chain = [m]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        packages = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)} & edges.keys()
        for n in sorted(edges[m] | packages):
            if n not in came_from:
                came_from[n] = m
                todo.append(n)
    return None


def decoder_reached(edges: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each worker.kinds module but those that sample (all of them, found in the graph: a new kind is
    covered), and model loading and the memory plan, that reaches worker.decode: its chain."""
    starts = [m for m in edges if m.split(".")[:2] == ["worker", "kinds"] and m not in DECODING_KINDS] + list(LOADING)
    return {m: chain for m in sorted(starts) if (chain := import_chain(edges, m, "worker.decode"))}


def test_no_supervised_kind_reaches_the_decoder():
    """Loading a model for SFT, DPO, KTO or a reward model loads no part of GRPO's decoder
    (worker/decode/): what loading and memory planning share with it lives in worker/runtime/."""
    edges, _, _ = GRAPH
    assert {"worker.kinds.sft_job", "worker.kinds.dpo_job", "worker.kinds.kto_job",
            "worker.kinds.supervised_trainer"} <= {m for m in edges if m.startswith("worker.kinds.")} - set(DECODING_KINDS)
    reached = decoder_reached(edges)
    assert reached == {}, "\n".join(" -> ".join(chain) for chain in reached.values())
    assert import_chain(edges, "worker.kinds.grpo", "worker.decode")  # ...while GRPO does


def test_a_planted_import_of_the_decoder_is_found_through_a_runtime_module(tmp_path):
    """The check above must fail when what it guards breaks: a new kind that reaches the decoder
    through a runtime module's import in a function body; GRPO's own import is allowed."""
    for pkg, files in {
        "worker": {"kinds/x.py": "from worker.runtime import helper\n", "kinds/grpo.py": "from worker.decode import y\n",
                   "runtime/helper.py": "def f():\n    from worker.decode.y import step\n",
                   "runtime/models.py": "", "runtime/memory_plan.py": "import worker.runtime.models\n",
                   "decode/y.py": "step = 1\n"},
        "shared": {}, "api": {}, "cli": {},
    }.items():
        for name in ("__init__.py", *files):
            path = tmp_path / pkg / name
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / "__init__.py").touch()
            path.write_text(files.get(name, ""))
    edges, _, _ = read_graph(tmp_path)
    assert decoder_reached(edges) == {"worker.kinds.x": ["worker.kinds.x", "worker.runtime.helper", "worker.decode.y"]}
    # A package's __init__ runs before any of its modules: one that imports the decoder counts.
    (tmp_path / "worker" / "runtime" / "__init__.py").write_text("import worker.decode\n")
    reached = decoder_reached(read_graph(tmp_path)[0])
    assert set(reached) == {"worker.kinds.x", "worker.runtime.models", "worker.runtime.memory_plan"}
    assert reached["worker.runtime.models"] == ["worker.runtime.models", "worker.runtime", "worker.decode"]


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


# --------------------------------------------------------------------------- the trackers

TRACKER_LIBRARIES = ("tensorboardX", "tensorboard", "mlflow", "wandb")


def tracker_library_importers(external: dict[str, set[str]]) -> list[str]:
    """Modules outside worker/trackers/ that import a tracker library."""
    return sorted(m for m, names in external.items()
                  if names & set(TRACKER_LIBRARIES) and not m.startswith("worker.trackers."))


def test_only_the_tracker_processes_import_a_tracker_library():
    """A tracker library (its imports, its threads, its hangs) stays in the tracker processes
    (docs/trackers.md): neither the training process, the supervisor nor the API loads one. The
    supervisor starts them by a module's name, which must have a `main`."""
    edges, _, external = GRAPH
    assert tracker_library_importers(external) == []
    assert {m for m, names in external.items() if names & set(TRACKER_LIBRARIES)} == {
        "worker.trackers.tb_writer", "worker.trackers.mlflow_writer", "worker.trackers.wandb_writer"}
    assert not any(m.startswith("worker.trackers") for m in reachable(edges, [m for m in edges if m.startswith("worker.supervisor.")]))
    assert names_a_function(ROOT, string_constant(ROOT, "worker.supervisor.trackers", "TRACKER_MAIN") + ".main")


def test_a_planted_tracker_import_is_found(tmp_path):
    for pkg, files in {"worker": {}, "worker/runtime": {"loop.py": "def f():\n    import mlflow\n"},
                       "worker/trackers": {"tb.py": "from tensorboardX import SummaryWriter\n"},
                       "shared": {}, "api": {}, "cli": {}}.items():
        (tmp_path / pkg).mkdir()
        for name, text in {"__init__.py": "", **files}.items():
            (tmp_path / pkg / name).write_text(text)
    _, _, external = read_graph(tmp_path)
    assert tracker_library_importers(external) == ["worker.runtime.loop"]
