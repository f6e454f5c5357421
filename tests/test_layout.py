"""The package's shape: one import name, imports that point one way (the engine's wings on floors, no circles), a
server that reaches the engine through the contract, the text wing and the handle, and a wheel that installs only
`kvfree`."""

from __future__ import annotations

import ast
import os
import shutil
import site
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
OLD_TOP_LEVEL = ("engine", "kernels", "server", "checkpoints", "clients", "loadtest", "training")

# What each subpackage may import of kvfree (architecture: server -> engine -> kernels; clients and loadtest speak
# HTTP only; the CLI in kvfree/ sits above everything).
ALLOWED: dict[str, tuple[str, ...]] = {
    "kvfree.kernels": ("kvfree.kernels",),
    "kvfree.checkpoints": ("kvfree.checkpoints",),
    "kvfree.engine": ("kvfree.engine", "kvfree.kernels", "kvfree.checkpoints"),
    "kvfree.server": ("kvfree.server", "kvfree.engine", "kvfree.kernels", "kvfree.checkpoints"),
    "kvfree.training": ("kvfree.training", "kvfree.engine", "kvfree.kernels", "kvfree.checkpoints"),
    "kvfree.clients": ("kvfree.clients",),
    "kvfree.loadtest": ("kvfree.loadtest", "kvfree.clients"),
}


def modules() -> list[tuple[str, Path]]:
    """(dotted module name, file) for every module of the distribution, from pyproject's package-dir mapping."""
    out = []
    for package, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        # kvfree/ holds its own modules and the benchmarks (kvfree/bench/); the other subpackages are mapped from
        # top-level folders (on a device copy, links to them inside kvfree/ must not be walked twice).
        files = [*base.glob("*.py"), *(base / "bench").rglob("*.py")] if package == "kvfree" else base.rglob("*.py")
        for path in sorted(files):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            out.append((".".join([package, *parts]), path))
    return out


def _owner(name: str) -> str:
    return ".".join(name.split(".")[:2])


def imported_modules(name: str, path: Path, *, type_only: bool = True, with_names: bool = False) -> set[str]:
    """Absolute names of the modules `path` imports, anywhere in the file (lazy imports inside functions too);
    without `type_only`, leaving out those under `if TYPE_CHECKING:` (annotations, never run); `with_names`: each
    name a `from` import takes, too (`from kvfree.engine.core import stepper` imports the module stepper)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    skipped: set[int] = set()
    if not type_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(sub) for sub in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            out.add(module)
            if with_names:
                out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def known_module(module: str, names: set[str]) -> str | None:
    """The module of the distribution an import names (`from kvfree.engine.protocol import X` names
    kvfree.engine.protocol; `from kvfree.engine.text import grammar` the package), None outside it."""
    while module and module not in names:
        module = module.rpartition(".")[0]
    return module or None


def test_pyproject_lists_every_package_directory():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set()
    for package, folder in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if package == "kvfree" and rel.parts and rel.parts[0] != "bench":
                continue  # (a link to a mapped folder, on a device copy)
            found.add(".".join([package, *rel.parts]))
    assert listed == found


def test_imports_point_one_way():
    broken = []
    for name, path in modules():
        owner = _owner(name)
        for module in imported_modules(name, path):
            if module.split(".")[0] in OLD_TOP_LEVEL:
                broken.append(f"{path.relative_to(ROOT)} imports {module} (not under kvfree)")
            if owner in ALLOWED and module.startswith("kvfree") and not module.startswith(ALLOWED[owner]):
                broken.append(f"{path.relative_to(ROOT)} ({owner}) imports {module}")
    assert not broken, "\n".join(broken)


# The engine's wings, and what each may import of kvfree besides itself (type-only imports are not counted). The
# floors: protocol <- text, model <- state <- sessions <- core <- parallel <- serving, with the offline API (llm.py)
# and the package face (engine/__init__.py) on top; docs/design/architecture.md draws them.
PROTOCOL, TEXT, MODEL, STATE, SESSIONS, CORE, PARALLEL = (
    f"kvfree.engine.{wing}" for wing in ("protocol", "text", "model", "state", "sessions", "core", "parallel")
)
ENGINE_WINGS: dict[str, tuple[str, ...]] = {
    PROTOCOL: (),
    TEXT: (PROTOCOL, "kvfree.checkpoints"),
    MODEL: (PROTOCOL, "kvfree.kernels", "kvfree.checkpoints"),
    STATE: (PROTOCOL, MODEL, "kvfree.kernels"),
    SESSIONS: (PROTOCOL, STATE),
    CORE: (PROTOCOL, TEXT, MODEL, STATE, SESSIONS, "kvfree.kernels"),
    PARALLEL: (PROTOCOL, TEXT, MODEL, STATE, CORE, "kvfree.checkpoints"),
    "kvfree.engine.serving": (PROTOCOL, TEXT, MODEL, STATE, SESSIONS, CORE, PARALLEL, "kvfree.checkpoints"),
    "kvfree.engine.llm": (PROTOCOL, TEXT, MODEL, STATE, SESSIONS, CORE, PARALLEL, "kvfree.checkpoints"),
    "kvfree.engine": ("kvfree.engine.llm", PROTOCOL, MODEL, STATE),  # the package face: `from kvfree.engine import LLM`
}


def engine_wing(name: str) -> str:
    """The wing a module of kvfree.engine lives in: kvfree.engine.<wing> (the face's is kvfree.engine)."""
    return ".".join(name.split(".")[:3])


def test_every_engine_module_is_in_a_wing_that_imports_only_the_wings_below_it():
    broken = []
    for name, path in modules():
        if not name.startswith("kvfree.engine"):
            continue
        wing = engine_wing(name)
        if wing not in ENGINE_WINGS:
            broken.append(f"{path.relative_to(ROOT)} is in no wing ({wing})")
            continue
        for module in imported_modules(name, path, type_only=False):
            outside = engine_wing(module) != wing and not module.startswith(ENGINE_WINGS[wing])
            if module.startswith("kvfree") and outside:
                broken.append(f"{path.relative_to(ROOT)} ({wing}) imports {module}")
    assert not broken, "\n".join(broken)


def test_no_modules_import_each_other_in_a_circle():
    """Over the whole distribution, lazy imports counted: no strongly connected set of modules but single ones
    (a type-only import, under TYPE_CHECKING, may point back: it never runs)."""
    names = {name for name, _ in modules()}
    arrows = {name: set() for name in names}
    for name, path in modules():
        for module in imported_modules(name, path, type_only=False, with_names=True):
            target = known_module(module, names)
            if target is not None and target != name and not name.startswith(target + "."):
                arrows[name].add(target)  # (a module's import of its own package's face is not an arrow back)
    assert not circles(arrows), circles(arrows)


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one node in a directed graph (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(arrows):
        if root in index:
            continue
        work = [(root, iter(sorted(arrows[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(sorted(members))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(arrows.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_circle_finder_sees_a_circle_and_nothing_else():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_benchmarks_are_imported_by_nothing_but_the_command_line():
    broken = []
    for name, path in modules():
        if name.startswith("kvfree.bench") or name == "kvfree.cli":
            continue
        imports = imported_modules(name, path)
        broken += [f"{path.relative_to(ROOT)} imports {m}" for m in sorted(imports) if m.startswith("kvfree.bench")]
    assert not broken, "\n".join(broken)


def test_import_rule_checker_sees_violations(tmp_path):
    """The walker above resolves relative and lazy imports, so a violation cannot hide behind either."""
    (tmp_path / "__init__.py").write_text("def f():\n    from ..server import app\n")
    assert "kvfree.server" in imported_modules("kvfree.engine", tmp_path / "__init__.py")
    (tmp_path / "mod.py").write_text("from .layers import base\nimport kvfree.loadtest.cli\n")
    assert imported_modules("kvfree.engine.mod", tmp_path / "mod.py") == {"kvfree.engine.layers", "kvfree.loadtest.cli"}
    (tmp_path / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvfree.engine.core import stepper\n"
    )
    assert "kvfree.engine.core" in imported_modules("kvfree.engine.typed", tmp_path / "typed.py")
    assert "kvfree.engine.core" not in imported_modules("kvfree.engine.typed", tmp_path / "typed.py", type_only=False)


# The engine's insides, which the HTTP front must not reach into: it talks to the engine through
# server/lifecycle.py and learns the engine's facts from its EngineInfo, so that the engine can move to a process of
# its own. The first are read on nothing in server/; the second not on anything called an engine.
ENGINE_INTERNALS = frozenset({"llm", "core", "stepper", "runtime", "scheduler", "runner", "pool"})
ENGINE_PARTS = frozenset({"sessions", "tokenizer"})
# The modules that may hold the engine itself (a ProcessDriver or a ThreadDriver): the app builds and starts it, the
# lifecycle module talks to it.
ENGINE_HOLDERS = frozenset({"kvfree.server.app", "kvfree.server.lifecycle"})
# The app takes the server's one tokenizer from the engine (its own, or the front's copy of the checkpoint's).
ENGINE_REACH_ALLOWED = {"kvfree.server.app": {"engine.tokenizer"}}


def engine_reaches(path: Path) -> list[str]:
    """The attribute reads in `path` that reach into an engine, as source text: one of ENGINE_INTERNALS on
    anything, or one of ENGINE_PARTS on a name or attribute whose name contains `engine`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
        if node.attr in ENGINE_INTERNALS or (node.attr in ENGINE_PARTS and "engine" in owner):
            found.append(ast.unparse(node))
    return found


def test_server_modules_reach_the_engine_only_through_the_lifecycle_module():
    broken = []
    for name, path in modules():
        if not name.startswith("kvfree.server"):
            continue
        rel = path.relative_to(ROOT)
        allowed = ENGINE_REACH_ALLOWED.get(name, set())
        broken += [f"{rel} reads {reach}" for reach in engine_reaches(path) if reach not in allowed]
        if name not in ENGINE_HOLDERS:
            held = imported_modules(name, path) & {
                "kvfree.engine.serving.thread_driver", "kvfree.engine.serving.handle",
                "kvfree.engine.serving.process_driver",
                "kvfree.engine.llm",
            }
            broken += [f"{rel} imports {module} (only the app and server/lifecycle.py hold the engine)" for module in
                       sorted(held)]  # fmt: skip
    assert not broken, "\n".join(broken)


# What of the engine the HTTP front imports (type-only imports aside), and which of its modules may (None: any): the
# contract and the front's vocabulary (the text wing) anywhere; the engine's handle and drivers where the engine is
# held; the snapshot file format where an upload's header is checked before the engine sees the file.
FRONT_REACH: dict[str, frozenset[str] | None] = {
    "kvfree.engine.protocol": None,
    "kvfree.engine.text": None,
    "kvfree.engine.serving.handle": frozenset({"kvfree.server.lifecycle"}),
    "kvfree.engine.serving.thread_driver": frozenset({"kvfree.server.app"}),
    "kvfree.engine.serving.process_driver": frozenset({"kvfree.server.app"}),
    "kvfree.engine.state.snapshot": frozenset({"kvfree.server.routes_sessions"}),
}


def test_the_server_imports_the_engine_only_through_the_contract_the_text_wing_and_the_handle():
    broken = []
    for name, path in modules():
        if not name.startswith("kvfree.server"):
            continue
        for module in sorted(imported_modules(name, path, type_only=False)):
            if not module.startswith("kvfree.engine"):
                continue
            reach = next((r for r in FRONT_REACH if module == r or module.startswith(r + ".")), None)
            if reach is None or (FRONT_REACH[reach] is not None and name not in FRONT_REACH[reach]):
                broken.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not broken, "\n".join(broken)


def test_engine_reach_checker_sees_reaches_and_nothing_else(tmp_path):
    """Reads through a chain and through a private name are found; a `sessions` gauge of the metrics is not one."""
    (tmp_path / "mod.py").write_text(
        "a = state.engine.llm.pool.capacity\nb = engine.sessions\nc = self._engine.tokenizer\n"
        "d = metrics.sessions\ne = state.tokenizer\n"
    )
    assert sorted(engine_reaches(tmp_path / "mod.py")) == sorted(
        ["state.engine.llm.pool", "state.engine.llm", "engine.sessions", "self._engine.tokenizer"]
    )


def test_every_module_opens_with_a_docstring_and_cites_only_the_repo():
    missing, outside = [], []
    for _, path in modules():
        text = path.read_text()
        if ast.get_docstring(ast.parse(text)) is None:
            missing.append(str(path.relative_to(ROOT)))
        if "shared/" in text:
            outside.append(str(path.relative_to(ROOT)))
    assert not missing, f"modules without a docstring: {missing}"
    assert not outside, f"modules citing files outside the repository: {outside}"


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with kvfree installed from a wheel (not editable).

    Its own site-packages holds only kvfree; the dependencies (torch, fastapi, ...) are reached through a .pth line
    naming this interpreter's site-packages. A plain path line does not run the .pth files there, so the editable
    install of the checkout stays invisible.
    """
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a copy of the tracked files, so the build writes nothing into the checkout and sees nothing
    # that a clean clone lacks.
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    source = tmp / "src"
    for rel in tracked:
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    wheels = tmp / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, source]
    subprocess.run(build, check=True, cwd=tmp, timeout=300)
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    (wheel,) = wheels.glob("kvfree-*.whl")
    install = [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel]
    subprocess.run(install, check=True, cwd=tmp, timeout=300)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    ours = [p for p in {*site.getsitepackages(), site.getusersitepackages()} if Path(p).is_dir()]
    (Path(purelib) / "_kvfree_test_deps.pth").write_text("\n".join(ours) + "\n")
    return env_dir


def _run(env_dir: Path, *args: str | Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [*map(str, args)], cwd=env_dir.parent, env=env, capture_output=True, text=True, timeout=300
    )


def test_wheel_installs_one_top_level_package(wheel_venv):
    python = wheel_venv / "bin" / "python"
    probe = (
        "import importlib.util, kvfree, pathlib\n"
        "print(pathlib.Path(kvfree.__file__).parent)\n"
        f"print([n for n in {OLD_TOP_LEVEL!r} if importlib.util.find_spec(n) is not None])\n"
        "from kvfree import LLM, SamplingParams\n"
        "import kvfree.engine.model.layers, kvfree.kernels.mamba2, kvfree.server.app, kvfree.loadtest.cli\n"
        "print(kvfree.__version__)\n"
    )
    result = _run(wheel_venv, python, "-c", probe)
    assert result.returncode == 0, result.stderr
    location, stray, version = result.stdout.split("\n")[:3]
    assert Path(location).is_relative_to(wheel_venv), "kvfree came from the checkout, not the wheel"
    assert stray == "[]"
    assert version == PYPROJECT["project"]["version"]


def test_wheel_console_script(wheel_venv):
    kvfree = wheel_venv / "bin" / "kvfree"
    result = _run(wheel_venv, kvfree, "--help")
    assert result.returncode == 0 and "serve" in result.stdout, result.stderr
    result = _run(wheel_venv, kvfree, "generate", "Hi", "--max-tokens", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hi") and "[4 tokens in" in result.stderr
