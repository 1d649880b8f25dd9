"""The clip coefficient is typed once (dormouse.clip.clip_coef) and is
the factor torch.nn.utils.clip_grad_norm_ multiplies the gradients by."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import torch

import dormouse
from dormouse.clip import clip_coef

PKG = Path(dormouse.__file__).resolve().parent
# x / (norm + 1e-6) in code (strings and comments left out): the clip coefficient's denominator
FORMULA = re.compile(r"/\(\w+(\.\w+)*\+(1e-6|1e-06|0\.000001|CLIP_EPS)\)")


def formula_sites(path: Path) -> list[int]:
    """The lines of `path` whose code (not its strings or comments) divides by (something + 1e-6)."""
    lines: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
            lines[tok.start[0]] = lines.get(tok.start[0], "") + tok.string
    return [n for n, code in sorted(lines.items()) if FORMULA.search(code)]


def test_the_clip_coefficient_is_written_in_one_place_in_the_package():
    found = [str(p.relative_to(PKG)) for p in sorted(PKG.rglob("*.py")) for _ in formula_sites(p)]
    assert found == ["clip.py"]


def test_the_search_for_the_formula_sees_it_in_code_and_not_in_prose(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""c = min(1, max / (norm + 1e-6))"""\n# min(1, m / (n + 1e-6))\n'
                       "c = min(1.0, self.max_grad_norm / (grad_norm + 1e-6))\n"
                       "t = torch.clamp(m / (n + 1e-6), max=1.0)\n")
    assert formula_sites(planted) == [3, 4]


def test_the_coefficient_is_the_factor_torchs_clip_grad_norm_scales_by():
    g = torch.Generator().manual_seed(0)
    for max_norm in (0.5, 1e3):  # binds, and does not
        params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        before = [p.grad.clone() for p in params]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        coef = clip_coef(max_norm, norm)
        assert all(torch.equal(p.grad, b * coef) for p, b in zip(params, before))  # bitwise torch's
        expected = min(1.0, max_norm / (float(norm) + 1e-6))
        assert abs(clip_coef(max_norm, float(norm)) - expected) <= 1e-15 and float(coef) <= 1.0
    assert clip_coef(1.0, 0.0) == 1.0 and clip_coef(1.0, 3.0) == 1.0 / (3.0 + 1e-6)
