"""The C sources' files depend on each other one way: a file that uses what another defines (a
function or variable declared in a header it includes) is above it, and nothing below uses it back,
so each file can be read (and changed) knowing only the files below it. Pure text parsing, no
compiler: the includes, each file's external definitions, and the identifiers each file uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

_COMMENTS_AND_STRINGS = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"', re.S)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# A definition at file scope that is not static: a function (its body follows) or a variable.
_FUNCTION = re.compile(r"^(?!static\b|extern\b|typedef\b)[A-Za-z_][\w \t*]*?\b(\w+)\s*\([^;{]*\)\s*\{", re.M)
_VARIABLE = re.compile(
    r"^(?!static\b|extern\b|typedef\b|struct\b[^=;]*\{)[A-Za-z_][\w \t*]*?\b(\w+)\s*(?:\[[^\]]*\])?\s*[=;]",
    re.M,
)
_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")


def _code(path: Path) -> str:
    return _COMMENTS_AND_STRINGS.sub(" ", path.read_text())


def _headers(source: Path, root: Path) -> set[Path]:
    """The project headers `source` includes, directly or through other headers."""
    seen: set[Path] = set()
    pending = [source]
    while pending:
        current = pending.pop()
        for name in _INCLUDE.findall(current.read_text()):
            header = (current.parent / name).resolve()
            if header.is_file() and header.is_relative_to(root) and header not in seen:
                seen.add(header)
                pending.append(header)
    return seen


def dependencies(root: Path) -> dict[str, set[str]]:
    """Each .c file under root (relative name) and the .c files whose definitions it uses, found
    through the headers it includes."""
    root = root.resolve()
    sources = sorted(root.rglob("*.c"))
    defined_in: dict[str, Path] = {}
    for source in sources:
        code = _code(source)
        for name in _FUNCTION.findall(code) + _VARIABLE.findall(code):
            defined_in.setdefault(name, source)
    graph: dict[str, set[str]] = {}
    for source in sources:
        declared = {name for header in _headers(source, root) for name in _IDENTIFIER.findall(_code(header))}
        used = set(_IDENTIFIER.findall(_code(source))) & declared
        graph[str(source.relative_to(root))] = {
            str(defined_in[name].relative_to(root))
            for name in used
            if name in defined_in and defined_in[name] != source
        }
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (its files in order, the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == 1:
                return [*path[path.index(successor) :], successor]
            if successor not in state and (found := visit(successor)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_a_cycle_is_found() -> None:
    assert cycle({"a.c": {"b.c"}, "b.c": {"c.c"}, "c.c": {"a.c"}}) == ["a.c", "b.c", "c.c", "a.c"]
    assert cycle({"a.c": {"b.c"}, "b.c": set()}) == []


def test_the_parser_sees_a_dependency(repo_root: Path) -> None:
    # devices.c starts the monitor: were the parser blind, the test below would pass vacuously.
    assert "monitor.c" in dependencies(repo_root / "hook" / "src")["devices.c"]


@pytest.mark.parametrize("directory", ["hook/src", "tools/fakegpu/src"])
def test_no_cycle(repo_root: Path, directory: str) -> None:
    assert cycle(dependencies(repo_root / directory)) == []
