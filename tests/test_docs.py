"""Every ```python block of README.md and docs/*.md runs as written.

Each block is one test: it runs in a fresh interpreter (no names or state carried over from an
earlier block), on CPU, with a wall-clock limit, from an empty temporary folder, so a snippet that
relies on an undefined name, a missing import, a file of the checkout or a GPU fails here. Non-Python or deliberately non-runnable text belongs
in ```bash / ```text blocks.
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
        res = subprocess.run([sys.executable, "-c", _RUNNER, str(script), name], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=SNIPPET_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: the snippet ran longer than {SNIPPET_LIMIT_S} s")
    assert res.returncode == 0, f"{name} failed:\n{res.stderr[-4000:]}"
