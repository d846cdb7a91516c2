"""Every ```python block of README.md and docs/*.md runs as written.

Each block is one test: it is compiled and executed in a fresh namespace (no names carried over
from an earlier block), on CPU, with a wall-clock limit, so a snippet that relies on an undefined
name, a missing import or a GPU fails here. Non-Python or deliberately non-runnable text belongs
in ```bash / ```text blocks.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Seconds one snippet may take on this project's 2-core machine under load (docs promise < 5 s idle).
SNIPPET_LIMIT_S = 60

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


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


@pytest.mark.parametrize("path, line, source", SNIPPETS,
                         ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, _ in SNIPPETS])
def test_snippet_runs(path, line, source, monkeypatch, tmp_path):
    import torch

    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    code = compile(source, f"{path.relative_to(ROOT)}:{line}", "exec")
    namespace = {"__name__": "__doc_snippet__"}
    threads = torch.get_num_threads()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SNIPPET_LIMIT_S)
    try:
        exec(code, namespace)
    except _Timeout:
        pytest.fail(f"{path.name}:{line}: the snippet ran longer than {SNIPPET_LIMIT_S} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        torch.set_num_threads(threads)
