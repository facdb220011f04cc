"""The layers of pyproject.toml's import-linter contracts hold, and a violation breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.architecture
REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "connectors", "udfs", "operators", "jobs", "streamtune")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    # From `root`, the packages there shadow the installed ones (the current directory comes first).
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_layers_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("operators/windowing.py", "import streamtune.stack", "operators is not allowed to import streamtune"),
    ("connectors/kafka.py", "import jobs.wiring", "connectors is not allowed to import jobs"),
    ("udfs/json_path.py", "import operators.validate", "udfs is not allowed to import operators"),
    ("core/errors.py", "import connectors.kafka", "core is not allowed to import connectors"),
    ("core/defaults.py", "import kafka", "core is not allowed to import kafka"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, line, contract):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}  # the violation under test\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and contract in result.stdout, result.stdout + result.stderr
