"""bench/ is a suite of benchmarks, not a lab: no experiment scripts or their results in the tree, nothing outside
bench/ imports it, and every result README.md or docs/*.md names exists where they say (in bench/results/, or
in git history at the archive tag)."""
import ast
import re
import shutil
import subprocess

import pytest

from conftest import REPO

TAG = "lab-archive-2026-12"
DOCS = {"README.md": REPO / "README.md", **{f"docs/{p.name}": p for p in sorted((REPO / "docs").glob("*.md"))}}
# bench/results/NAME.json, optionally as REV:bench/results/NAME.json (a file in git history)
PATH_REF = re.compile(r"(?:([\w.-]+):)?bench/results/([a-z0-9][a-z0-9.-]*\.json)")
# a result named alone, in backticks: results are lowercase-hyphenated (e2e-h200.json); config.json and
# kv_scales.json are not
BARE_REF = re.compile(r"`([a-z0-9]+(?:-[a-z0-9.]+)+\.json)`")


def _refs(text: str) -> tuple[set[str], set[tuple[str, str]], set[str]]:
    """-> (paths in the tree, (rev, path) in history, bare names)."""
    here, history = set(), set()
    for rev, name in PATH_REF.findall(text):
        if rev:
            history.add((rev, f"bench/results/{name}"))
        else:
            here.add(name)
    return here, history, set(BARE_REF.findall(text))


def _in_tree(name: str) -> bool:
    return (REPO / "bench" / "results" / name).is_file()


def test_bench_holds_no_experiment_scripts_or_results():
    assert sorted(p.name for p in (REPO / "bench").glob("exp_*.py")) == []
    assert sorted(p.name for p in (REPO / "bench" / "results").glob("exp-*.json")) == []
    assert not (REPO / "bench" / "NOTES-kernels.md").exists(), "the kernel notes live in docs/kernels.md"


def test_nothing_outside_bench_imports_bench():
    skip = {"bench", "build", "dist", "node_modules"}
    bad = []
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in skip or any(part.startswith(".") or "venv" in part for part in rel.parts[:-1]):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            bad += [f"{rel}: {n}" for n in names if n == "bench" or n.startswith("bench.")]
    assert bad == [], "bench/ holds scripts; load a helper by its path or move product code into the package"


@pytest.mark.parametrize("doc", list(DOCS))
def test_results_cited_as_present_exist(doc):
    here, _, bare = _refs(DOCS[doc].read_text())
    missing = sorted(name for name in here if not _in_tree(name))
    assert missing == [], f"{doc} cites bench/results files that are not there: {missing}"
    if doc == "README.md":           # the README cites present results only; history goes through docs/kernels.md
        assert sorted(name for name in bare if not _in_tree(name)) == []
    assert sorted(name for name in here | bare if name.startswith("exp-") and _in_tree(name)) == []


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def test_results_in_history_exist_at_the_tag():
    if shutil.which("git") is None:
        pytest.skip("no git: the history references cannot be checked")
    if _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip(f"{REPO} is not a git checkout")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("shallow clone: the history the docs cite is not here")
    if _git("rev-parse", "-q", "--verify", f"refs/tags/{TAG}").returncode != 0:
        pytest.skip(f"tag {TAG} is absent (fetch it with `git fetch origin tag {TAG}`)")
    wanted = set()
    for text in (p.read_text() for p in DOCS.values()):
        _, history, _ = _refs(text)
        wanted |= history
    _, _, bare = _refs(DOCS["docs/kernels.md"].read_text())
    wanted |= {(TAG, f"bench/results/{name}") for name in bare if not _in_tree(name)}
    assert any(path.startswith("bench/results/exp-") for _, path in wanted)   # the table of what was not kept
    objects = [f"{rev}:{path}" for rev, path in sorted(wanted)]
    out = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch-check"], input="\n".join(objects) + "\n",
                         capture_output=True, text=True, check=True).stdout.splitlines()
    missing = [obj for obj, line in zip(objects, out) if line.endswith("missing")]
    assert missing == [], f"named as in history but not there: {missing}"
