"""The house's import arrows point down: mst_core <- each method package <- the planner (mst_planner, a tool on
top). The core imports no method; a method imports the core and no other method; nothing imports the planner."""

import ast
from pathlib import Path

import pytest


SRC = Path(__file__).resolve().parents[1] / "src" / "transformers"
CORE = "mst_core"
METHODS = ("mini_sequence", "streaming_backward", "adjoint_sharding", "ulysses")
TOOLS = ("mst_planner",)
OURS = (CORE, *METHODS, *TOOLS)


def our_imports(path: Path):
    """(line, our package) for every import in `path` that reaches one of our packages, relative or absolute."""
    package = path.relative_to(SRC).parts[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            elif node.level == 1:  # `from .x import y` / `from . import y`: inside the same package
                names = [package]
            else:  # `from ..x import y` reaches transformers.x; `from .. import x` reaches transformers.x too
                names = [node.module] if node.module else [alias.name for alias in node.names]
            names = [n.removeprefix("transformers.") for n in names]
        elif isinstance(node, ast.Import):
            names = [alias.name.removeprefix("transformers.") for alias in node.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in OURS:
                found.append((node.lineno, top))
    return found


def modules(packages):
    return [path for package in packages for path in sorted((SRC / package).rglob("*.py"))]


def test_every_package_of_ours_is_known():
    """A new package must take its place in the layers (this test's lists)."""
    ours = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert ours == set(OURS)


@pytest.mark.parametrize("path", modules(OURS), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
    package = path.relative_to(SRC).parts[0]
    if package == CORE:
        allowed = {CORE}
    elif package in METHODS:
        allowed = {CORE, package}
    else:
        allowed = set(OURS)
    wrong = [(line, target) for line, target in our_imports(path) if target not in allowed]
    assert not wrong, f"{path.relative_to(SRC)} imports {wrong} (line, package); it may import only {sorted(allowed)}"


def test_the_check_sees_upward_imports(tmp_path, monkeypatch):
    """The parser resolves the import forms the packages use (the test above must be able to fail)."""
    fake = tmp_path / "transformers" / CORE
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("from ..mini_sequence.loss import f\nfrom . import fields\n"
                               "import transformers.mst_planner.plan\nfrom .. import streaming_backward\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path / "transformers")
    assert [t for _, t in our_imports(fake / "x.py")] == ["mini_sequence", CORE, "mst_planner", "streaming_backward"]
