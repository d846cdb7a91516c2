"""examples/serving.py runs (continuous batching + speculative decoding) and checks itself:
every request's tokens equal generating it alone."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "serving.py"


def test_serving_example_tokens_equal_generating_alone():
    r = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every request's tokens equal generating it alone" in r.stdout
    assert "equal to greedy decoding alone" in r.stdout
