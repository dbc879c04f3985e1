"""The runtime imports and generates with torch and transformers made unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCKER = r'''
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "onnx", "optimum"):
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, Block())
'''


def test_runtime_runs_without_torch(tiny_pair_dir: Path) -> None:
    code = BLOCKER + f'''
from specedge.runtime.pair import Pair, GenerationConfig
pair = Pair.load({str(tiny_pair_dir)!r})
r = pair.generate("The quick", GenerationConfig(max_new_tokens=8))
assert len(r.tokens) == 8, r
import specedge.runtime.backend, specedge.runtime.manifest, specedge.runtime.sampling
import specedge.runtime.speculative, specedge.runtime.drafters, specedge.runtime.text
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
print("ok")
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_cli_generate_without_torch(tiny_pair_dir: Path) -> None:
    code = BLOCKER + f'''
from specedge.cli import main
sys.argv = ["specedge", "generate", {str(tiny_pair_dir)!r}, "The quick", "--max-new-tokens", "4",
            "--json"]
main()
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"stop_reason"' in proc.stdout


def test_quantized_pair_generates_without_torch(fixtures_dir: Path) -> None:
    """A pair quantized by `specedge quantize` (static int8 QDQ) runs with torch blocked."""
    folder = fixtures_dir / "tiny-llama-int8static"
    code = BLOCKER + f'''
from specedge.runtime.pair import Pair, GenerationConfig
pair = Pair.load({str(folder)!r})
assert pair.manifest.target.precision == "int8", pair.manifest.target.precision
r = pair.generate("The quick", GenerationConfig(max_new_tokens=8, num_draft_tokens=2))
assert len(r.tokens) == 8
assert "torch" not in sys.modules and "onnx" not in sys.modules
print("ok")
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")
