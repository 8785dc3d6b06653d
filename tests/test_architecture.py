"""The package graph stays layered (docs/architecture.md): import-linter checks the contracts in
.importlinter, and an AST walk checks that no module imports another package's private name."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "pallas_kernels")


def _lint_imports() -> str | None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return exe if os.path.exists(exe) else None


def test_import_linter_contracts_hold():
    exe = _lint_imports()
    if exe is None:
        pytest.fail("lint-imports not installed: pip install -e '.[test]' (import-linter)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([exe, "--config", str(ROOT / ".importlinter"), "--no-cache"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path.name == "__init__.py", path


def _package_of(module: str) -> str:
    """The import-linter layer a module belongs to: jaxserve.<sub> or the top package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "jaxserve" else parts[0]


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def private_cross_package_imports() -> list[str]:
    """`from a.b import _x` or `import a._b` where a.b is in another package than the importer
    (module-level and in-function imports alike)."""
    found = []
    for module, is_package, path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, is_package, node)
                names = [f"{source}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in PACKAGES:
                    continue
                private = any(p.startswith("_") and not p.startswith("__")
                              for p in name.split("."))
                if private and _package_of(name) != _package_of(module):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return found


def test_no_private_name_imported_across_packages():
    assert private_cross_package_imports() == []


def test_private_import_check_catches_one(tmp_path, monkeypatch):
    """The AST check is not vacuous: a planted cross-package private import is reported."""
    fake = tmp_path / "jaxserve" / "engine"
    fake.mkdir(parents=True)
    (tmp_path / "jaxserve" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "x.py").write_text("def f():\n    from jaxserve.runner.sampler import _logprobs\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert private_cross_package_imports() == [
        "jaxserve/engine/x.py:2 imports jaxserve.runner.sampler._logprobs"]
