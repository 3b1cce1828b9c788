"""The README's first code block, run as written under torchrun (2 gloo ranks), against one process.

Tolerance: fp32, ``|sp - ref| <= 1e-5 + 1e-4 |ref|`` for the output and every gradient (only the order of fp32
sums differs). The block's own objects are saved with ``torch.save`` by an epilogue appended to it, which
also proves the output is a plain tensor (an ``AsyncCollectiveTensor`` does not load back).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EPILOGUE = """
import torch as _t
_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
_t.save({"out": out, "grads": _grads}, f"{_OUT}/rank{dist.get_rank()}.pt")
dist.destroy_process_group()
"""


def _readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_readme_snippet_gives_one_process_numbers(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(f"_OUT = {str(tmp_path)!r}\n" + _readme_block() + EPILOGUE)
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "sp-diffusers install" in proc.stdout  # the report the block prints

    from sp_diffusers.tiny import tiny_inputs, tiny_model

    reference = tiny_model("flux")
    ref = reference(**tiny_inputs("flux", reference), return_dict=False)[0]
    ref.square().mean().backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")  # weights_only: plain tensors only
        assert type(saved["out"]) is torch.Tensor
        assert ((saved["out"] - ref).abs() - 1e-4 * ref.abs()).max() <= 1e-5
        assert set(saved["grads"]) == set(ref_grads) and ref_grads
        for name, g_ref in ref_grads.items():
            assert ((saved["grads"][name] - g_ref).abs() - 1e-4 * g_ref.abs()).max() <= 1e-5, name
