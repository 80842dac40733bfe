"""What ships: the product wheel holds the product alone (contract, placement core, extender, device
plugin, hook, protos) and depends on no tool's libraries; the tools' wheel holds the simulator, the
sandbox and the fake GPU; and no shipped module imports a tool or the tests."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

PRODUCT = ("tessera", "extender", "nodeagent", "deviceplugin", "draplugin", "hook", "proto")
TOOLS = ("simulator", "sandbox", "fakegpu")
# Libraries only a tool needs; none may be a requirement of the product without an extra.
TOOL_ONLY_LIBRARIES = ("matplotlib", "tqdm", "rich")


def build_wheel(project: Path, out: Path) -> zipfile.ZipFile:
    # Built from a copy: a build writes build/ and *.egg-info into the project it builds. Not the
    # caches: Hypothesis's database changes under the copy while the fuzzers run in other workers
    # (CI saw its tmp directory vanish mid-copy).
    source = out / "source"
    shutil.copytree(
        project,
        source,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
        ),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            ".",
        ],
        cwd=source,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def top_levels(wheel: zipfile.ZipFile) -> set[str]:
    return {name.split("/")[0] for name in wheel.namelist() if ".dist-info/" not in name}


def requirements(wheel: zipfile.ZipFile) -> list[str]:
    [metadata] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return Parser().parsestr(wheel.read(metadata).decode()).get_all("Requires-Dist") or []


@pytest.fixture(scope="module")
def product_wheel(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(repo_root, tmp_path_factory.mktemp("product-wheel"))


def test_the_product_wheel_holds_only_the_product(product_wheel: zipfile.ZipFile) -> None:
    assert top_levels(product_wheel) == set(PRODUCT)
    names = product_wheel.namelist()
    for tool in (*TOOLS, "tests", "bench"):
        assert not [n for n in names if f"/{tool}/" in f"/{n}"], tool
    assert not [n for n in names if n.endswith((".c", ".png", "default.yaml"))]


def test_the_product_needs_no_tool_library(product_wheel: zipfile.ZipFile) -> None:
    unconditional = [r for r in requirements(product_wheel) if "extra ==" not in r]
    assert unconditional, "the product's runtime dependencies are missing from its metadata"
    for library in TOOL_ONLY_LIBRARIES:
        assert not [r for r in unconditional if r.lower().startswith(library)], library
    extras = [r for r in requirements(product_wheel) if "extra ==" in r]
    for extra in ("simulate", "sandbox"):
        assert any(r.startswith("tessera-tools") and f'extra == "{extra}"' in r for r in extras), extra


def test_the_tools_wheel_holds_the_tools(repo_root: Path, tmp_path: Path) -> None:
    wheel = build_wheel(repo_root / "tools", tmp_path)
    assert top_levels(wheel) == set(TOOLS)
    names = wheel.namelist()
    assert "simulator/data/default.yaml" in names
    assert "fakegpu/Makefile" in names
    assert [n for n in names if n.startswith("fakegpu/src/") and n.endswith(".c")]
    assert any(r.startswith("tessera==") for r in requirements(wheel))


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_imports_point_one_way(repo_root: Path) -> None:
    """The product imports no tool and no test; tools and benchmarks import no test."""
    offences = []
    for folder, forbidden in [
        *((repo_root / package, {*TOOLS, "tests", "bench"}) for package in PRODUCT),
        *((repo_root / "tools" / tool, {"tests", "bench"}) for tool in TOOLS),
        (repo_root / "bench", {"tests"}),
    ]:
        for path in sorted(folder.rglob("*.py")):
            wrong = imported_roots(path) & forbidden
            if wrong:
                offences.append(f"{path.relative_to(repo_root)} imports {sorted(wrong)}")
    assert offences == []


def test_the_node_agents_share_the_node_library_and_nothing_else(repo_root: Path) -> None:
    """What both node agents need is in nodeagent/; neither imports the other, and the library
    imports no agent."""
    offences = []
    for package, forbidden in [
        ("draplugin", {"deviceplugin"}),
        ("deviceplugin", {"draplugin"}),
        ("nodeagent", {"deviceplugin", "draplugin", "extender"}),
    ]:
        for path in sorted((repo_root / package).rglob("*.py")):
            wrong = imported_roots(path) & forbidden
            if wrong:
                offences.append(f"{path.relative_to(repo_root)} imports {sorted(wrong)}")
    assert offences == []
