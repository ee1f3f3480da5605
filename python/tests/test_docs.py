"""Without torch too: docs/torch.md lists every op knob and every public op of the package (read from the sources,
not imported)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "deltastack" / "torch"
DOC = (Path(__file__).resolve().parents[2] / "docs" / "torch.md").read_text()


def _assigned(path, name):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {path}")


def test_every_knob_is_documented():
    ops = _assigned(PKG / "patch.py", "PATCHABLE_OPS")
    assert len(ops) == 6
    for op in ops:
        assert f"`{op.upper()}`" in DOC, f"DELTASTACK_TORCH_{op.upper()} is not in docs/torch.md"


def test_every_public_op_is_documented():
    for name in _assigned(PKG / "ops.py", "__all__"):
        if name != "has_cuda":
            assert f"`{name}(" in DOC, f"{name} is not in docs/torch.md's table"
