"""Every ```python block of README.md and docs/*.md runs as written, and every reference to a
section of them (``docs/math.md "Chunkwise form"`` in code, tests and docs) names a heading there.

Each block is one test: it runs in a fresh interpreter (no names or state carried over from an
earlier block), on CPU, with a wall-clock limit, from an empty temporary folder, so a snippet that
relies on an undefined name, a missing import, a file of the checkout or a GPU fails here.
Non-Python or deliberately non-runnable text belongs in ```bash / ```text blocks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Seconds one snippet may take: generous, since the shared 2-core machine runs snippets several
#: times slower under load (a Hugging Face model snippet took 30 s at load average 7, > 60 s at 10).
SNIPPET_LIMIT_S = 180

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.MULTILINE | re.DOTALL)


def python_blocks(path: Path) -> List[Tuple[int, str]]:
    """``(line number, source)`` of each fenced block tagged ``python`` (or ``py``) in ``path``."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group("lang").strip().split(" ")[0].lower() in ("python", "py", "python3"):
            indent = len(m.group("indent"))
            body = "\n".join(line[indent:] for line in m.group("body").splitlines())
            blocks.append((text.count("\n", 0, m.start()) + 1, body))
    return blocks


SNIPPETS = [(p, line, src) for p in DOCS for line, src in python_blocks(p)]


def test_the_docs_have_python_snippets():
    # The extraction itself: README.md has runnable examples, so finding none means a broken regex.
    assert any(p.name == "README.md" for p, _, _ in SNIPPETS)


def test_fence_extraction_keeps_blocks_apart(tmp_path):
    md = tmp_path / "probe.md"
    md.write_text("a\n```python\nx = 1\n```\n\n```bash\nmake\n```\n  ```python\n  y = 2\n  ```\n")
    assert python_blocks(md) == [(2, "x = 1"), (9, "y = 2")]


# Each snippet runs in its own interpreter: snippets may change process-wide state (register a
# backend, set torch's thread count), which must reach neither the next snippet nor the rest of
# the suite. The code is compiled under the name "<doc>:<line>" so a traceback points into the doc.
_RUNNER = ("import sys; source = open(sys.argv[1], encoding='utf-8').read(); "
           "exec(compile(source, sys.argv[2], 'exec'), {'__name__': '__main__'})")


@pytest.mark.parametrize("path, line, source", SNIPPETS,
                         ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, _ in SNIPPETS])
def test_snippet_runs(path, line, source, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(source, encoding="utf-8")
    name = f"{path.relative_to(ROOT)}:{line}"
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONWARNINGS="ignore")
    try:
        res = subprocess.run([sys.executable, "-c", _RUNNER, str(script), name], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=SNIPPET_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: the snippet ran longer than {SNIPPET_LIMIT_S} s")
    assert res.returncode == 0, f"{name} failed:\n{res.stderr[-4000:]}"


# A section reference: a doc's path, optionally a comma or an opening parenthesis, then the
# section's name in double quotes (its heading or the heading's start; a name may hold a quoted
# word, as in The `backend="auto"` rule, so a quote ends it only before punctuation or a space).
# This file's own patterns and examples are not references.
_SECTION_REF = re.compile(
    r'(docs/[a-z_]+\.md|README\.md),? ?\(?"((?:[^"\n]|"(?=[\w`]))+?)"(?![\w`])')
# Where references live: code comments and docs (a comment's line breaks and markers are joined).
_REF_SOURCES = ("README.md", "docs", "src", "csrc", "tests", "benchmarks", "examples")
_COMMENT_BREAK = re.compile(r"\s*\n\s*(?:#|//|\*)?\s*")


def _headings(doc: Path) -> List[str]:
    return [line.lstrip("#").strip().replace("``", "`")
            for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def section_references(text: str) -> List[Tuple[str, str]]:
    """``(doc, section)`` pairs referenced in ``text``, comment line breaks joined."""
    joined = _COMMENT_BREAK.sub(" ", text)
    return [(m.group(1), m.group(2).replace("``", "`")) for m in _SECTION_REF.finditer(joined)]


def test_section_reference_extraction():
    text = ('# see docs/math.md "Chunkwise\n# form" and docs/benchmarks.md, "The `backend="auto"`\n'
            '// rule"; (docs/serving.md ("Backends", and README.md "Install")')
    assert section_references(text) == [("docs/math.md", "Chunkwise form"),
                                        ("docs/benchmarks.md", 'The `backend="auto"` rule'),
                                        ("docs/serving.md", "Backends"), ("README.md", "Install")]


def test_section_references_name_headings():
    files = [ROOT / "README.md"]
    for top in _REF_SOURCES[1:]:
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in
                  (".py", ".md", ".cpp", ".h", ".c", ".txt", ".sh")]
    headings = {}
    dangling, count = [], 0
    for path in files:
        if path == Path(__file__).resolve():
            continue
        for doc, section in section_references(path.read_text(encoding="utf-8")):
            if doc not in headings:
                headings[doc] = _headings(ROOT / doc) if (ROOT / doc).is_file() else []
            count += 1
            if not any(h.startswith(section) for h in headings[doc]):
                dangling.append(f"{path.relative_to(ROOT)}: {doc} \"{section}\"")
    assert count > 50, "the extraction found almost no references: a broken pattern"
    assert not dangling, "references to sections that do not exist:\n" + "\n".join(dangling)
