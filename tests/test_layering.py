"""The package layers (issue 21): the import graph of the top-level packages is acyclic, only bench
imports bench, and training stays out of engine/.

Static: every .py under the packages pyproject maps (flashpd/, engine/, prefill_node/, decode_node/,
kv_bridge/, cluster/, training/, bench/) is parsed with `ast`, every import counted (function-level
ones too), and each `flashpd.X...` module mapped to its top-level folder through pyproject's
setuptools package-dir (`flashpd.llm`, `flashpd.cli`, ... are the flashpd/ folder). No torch needed.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
import functools
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"proto_gen", "assets", "__pycache__"}  # generated gRPC modules; the shipped demo pair
EXPECTED = {"flashpd", "engine", "prefill_node", "decode_node", "kv_bridge", "cluster", "training", "bench"}


def package_dir() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def folder_of(module: str, pkg_dir: dict[str, str]) -> str | None:
    """The top-level folder that holds `module` (longest package-dir prefix), None outside flashpd."""
    best = None
    for pkg in pkg_dir:
        if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best)):
            best = pkg
    return None if best is None else Path(pkg_dir[best]).parts[0]


def package_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported_modules(path: Path, own_package: str) -> list[str]:
    """Every module an import statement in `path` names, anywhere in the file. For `from M import n`
    it is `M.n` (n may be a submodule; a name in M maps to M's folder just the same)."""
    tree = parsed(path)
    mods = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package that holds the file
                parts = own_package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            mods.extend(f"{base}.{a.name}" if a.name != "*" else base for a in node.names)
    return mods


@functools.cache
def import_graph() -> dict[tuple[str, str], set[str]]:
    """(importing folder, imported folder) -> the files that make the edge; self-edges left out."""
    pkg_dir = package_dir()
    folder_pkg = {v: k for k, v in pkg_dir.items()}
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for folder in sorted({Path(v).parts[0] for v in pkg_dir.values()}):
        for path in package_files(folder):
            rel = path.relative_to(ROOT)
            own = ".".join([folder_pkg[rel.parts[0]], *rel.parts[1:-1]])
            for mod in imported_modules(path, own):
                dst = folder_of(mod, pkg_dir)
                if dst is not None and dst != folder:
                    edges[(folder, dst)].add(rel.as_posix())
    return edges


def find_cycle(nodes: set[str], adj: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first; `adj` may be restricted to a part of the graph)."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for m in sorted(adj.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in color:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(nodes):
        if n not in color:
            found = visit(n)
            if found:
                return found
    return None


def describe(edges, pairs) -> str:
    return "\n".join(f"  {a} -> {b}: {', '.join(sorted(edges[(a, b)]))}" for a, b in pairs)


def test_packages_mapped():
    folders = {Path(v).parts[0] for v in package_dir().values()}
    assert EXPECTED <= folders, f"pyproject package-dir lacks {sorted(EXPECTED - folders)}"
    for f in folders:
        assert package_files(f), f"no .py files under {f}/"


def test_folder_mapping():
    pkg_dir = package_dir()
    assert folder_of("flashpd.llm", pkg_dir) == "flashpd"
    assert folder_of("flashpd.cli.add_sampling_args", pkg_dir) == "flashpd"
    assert folder_of("flashpd.decode_node.engine_loop", pkg_dir) == "decode_node"
    assert folder_of("flashpd.kv_bridge.proto_gen.kv_bridge_pb2", pkg_dir) == "kv_bridge"
    assert folder_of("flashpd_other", pkg_dir) is None and folder_of("torch.optim", pkg_dir) is None


def test_import_graph_is_acyclic():
    edges = import_graph()
    adj: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        adj[a].add(b)
    msgs = []
    while (cycle := find_cycle({n for e in edges for n in e}, adj)) is not None:
        # report it, then drop its last edge and look again, so every independent cycle shows
        msgs.append(" -> ".join(cycle) + "\n" + describe(edges, list(zip(cycle, cycle[1:]))))
        adj[cycle[-2]].discard(cycle[-1])
    assert not msgs, "import cycles between packages:\n" + "\n".join(msgs)


def test_only_bench_imports_bench():
    edges = import_graph()
    bad = sorted(e for e in edges if e[1] == "bench")
    assert not bad, "package code imports flashpd.bench (benchmarks stay out of package code):\n" + describe(edges, bad)


def test_engine_has_no_training():
    edges = import_graph()
    bad = sorted(e for e in edges if e == ("engine", "training"))
    assert not bad, "engine/ imports training code:\n" + describe(edges, bad)
    hits = []
    for path in package_files("engine"):
        for node in ast.walk(parsed(path)):
            rel = path.relative_to(ROOT).as_posix()
            if isinstance(node, ast.Attribute) and node.attr == "optim" and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                hits.append(f"{rel}:{node.lineno} torch.optim")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [f"{node.module}.{a.name}" for a in node.names]
                hits.extend(f"{rel}:{node.lineno} import {n}" for n in names if n.startswith("torch.optim"))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
                hits.append(f"{rel}:{node.lineno} .backward(")
    assert not hits, "training code in engine/ (it belongs in training/):\n  " + "\n  ".join(hits)


def _code_only(text: str) -> str:
    """The source without its strings and comments (a docstring may state the rule it implements)."""
    keep = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type not in (tokenize.STRING, tokenize.COMMENT)]
    return " ".join(keep)


def test_the_acceptance_rules_the_width_rule_and_the_slot_rule_are_each_defined_once():
    """Issue 21: the greedy and the sampled acceptance rule and the step-width rule live in engine/sampling.py
    (accepted_greedy, speculative_accept, step_width), the paged cache's slot rule in engine/kv_cache.py
    (slots_of); no other package module spells any of them out again."""
    slot = re.compile(r"[\]\w]\s*\*\s*[\w.]*(?:bs|block_size)\s*\+\s*\w+\s*%\s*[\w.]*(?:bs|block_size)")
    accept = re.compile(r"\.\s*cumprod\s*\(")
    width = re.compile(r"(?:max_tokens|\bM\b)[^\n]*-[^\n]*\+\s*1\b")  # what max_tokens admits: left + 1
    found: dict[str, list[str]] = {"slot": [], "accept": [], "width": []}
    for folder in ("engine", "decode_node", "prefill_node", "kv_bridge", "cluster", "training", "flashpd"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = _code_only(path.read_text())
            rel = path.relative_to(ROOT).as_posix()
            found["slot"] += [rel] * len(slot.findall(text))
            found["accept"] += [rel] * len(accept.findall(text))
            found["width"] += [rel] * len(width.findall(text))
    assert found["slot"] == ["engine/kv_cache.py"], found["slot"]
    assert found["width"] == ["engine/sampling.py"], found["width"]
    assert found["accept"] == ["engine/sampling.py", "engine/sampling.py"], found["accept"]
