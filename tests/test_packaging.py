"""One distribution, the same modules everywhere: the wheel, the editable install pytest imports, and the
tree mypy reads (.ci/mypy) all hold exactly the modules of the top-level folders mapped by package-dir."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def source_modules() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = set()
    for package, folder in config["package-dir"].items():
        for path in (ROOT / folder).glob("*.py"):
            modules.add(f"{package}.{path.stem}" if path.stem != "__init__" else package)
    return modules


LEFT_BY_BUILDS = (
    "build",
    "*.egg-info",
    ".venv",
    ".git",
    "test-artifacts",
    "__pycache__",
    ".*_cache",
    "*.db",
    "*.db-*",
)
"""What a checkout gathers that a fresh clone has not: setuptools' ``build/lib`` keeps a module deleted since
the last build and puts it in the next wheel."""


@pytest.mark.slow
def test_the_wheel_holds_exactly_the_source_modules_and_the_dashboard_assets(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(*LEFT_BY_BUILDS)
    )  # as a fresh clone builds it
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("ddpscope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n[:-3].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")}
    assert in_wheel == source_modules()
    assert {
        "ddpscope/dashboard/static/timeline.js",
        "ddpscope/dashboard/static/style.css",
        "ddpscope/dashboard/static/vendor/plotly-cartesian.min.js",
        "ddpscope/dashboard/static/vendor/plotly-LICENSE",
    } <= set(names)
    assert not any(n.startswith(("tests/", "bench/", "agent/", "server/")) for n in names)


def test_every_source_module_imports_from_this_checkout_under_its_ddpscope_name() -> None:
    for module in sorted(source_modules()):
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        assert Path(spec.origin).resolve().is_relative_to(ROOT), (module, spec.origin)


def test_the_training_side_imports_nothing_of_the_server_stack_and_the_server_never_imports_torch() -> None:
    code = (
        "import sys, ddpscope.agent, ddpscope.ddp; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'sqlalchemy', 'plotly', 'uvicorn')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    code = (
        "import sys, ddpscope.server.app, ddpscope.server.serve, ddpscope.dashboard; "
        "assert 'torch' not in sys.modules, 'the collector imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
