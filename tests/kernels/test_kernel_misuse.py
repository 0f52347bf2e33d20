"""A wrong call to a kernel raises a clear error naming the argument, on both
backends, and writes nothing; the triton backend's absence or limits are
reported plainly. [[RFC-0001:C-PADDING]] [[RFC-0001:C-DIRECT-WRITE]]"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpkv.kernels as K
from cpkv.contract.layout import SharedKVLayout

LAY = SharedKVLayout(2, 4, 3)  # 24 slots, 12 per rank
ROWS = 24


def _attn(**over):
    args = dict(q=torch.zeros(2, 4, 8), k_view=torch.zeros(ROWS, 2, 8), v_view=torch.zeros(ROWS, 2, 8),
                table=torch.tensor([[4, 5, 6]]), q_req=torch.tensor([0, 0]), q_pos=torch.tensor([1, 2]),
                layout=LAY, scaling=1.0)
    args.update(over)
    return args


ATTN_MISUSE = [
    (dict(q=torch.zeros(2, 4, 8, dtype=torch.float64)), TypeError, "q must be float32"),
    (dict(table=torch.tensor([[4.0, 5.0]])), TypeError, "table must be int32 or int64"),
    (dict(k_view=torch.zeros(ROWS - 1, 2, 8)), ValueError, "k_view: rows"),
    (dict(v_view=torch.zeros(ROWS, 2, 8, dtype=torch.float16)), TypeError, "share a dtype"),
    (dict(q=torch.zeros(2, 3, 8)), ValueError, "not a multiple"),
    (dict(q_pos=torch.tensor([1])), ValueError, "q_pos: length"),
    (dict(q_req=torch.tensor([0, 1])), IndexError, "q_req must index"),
    (dict(table=torch.tensor([[4, 5, 24]])), IndexError, "table: slot 24 is outside the layout"),
    (dict(table=torch.tensor([[4, -2, 6]])), IndexError, "table: slot -2 is outside the layout"),
    (dict(layout=(2, 4, 3)), TypeError, "layout must be a SharedKVLayout"),
    (dict(only_rank=2), ValueError, "only_rank=2 is not a rank"),
    (dict(backend="cuda"), ValueError, "unknown kernel backend"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("over,exc,msg", ATTN_MISUSE)
def test_paged_attention_misuse(backend, over, exc, msg):
    with pytest.raises(exc, match=msg):
        K.paged_attention(**{"backend": backend, **_attn(**over)})


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dsa_misuse(backend):
    q, w, keys = torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(ROWS, 8)
    t, qr, qp = torch.tensor([[4, 5]]), torch.tensor([0, 0]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="weights of shape"):
        K.index_scores(q, torch.zeros(2, 3), keys, t, qr, qp, LAY, 1.0, backend=backend)
    with pytest.raises(ValueError, match="key dim"):
        K.index_scores(q, w, torch.zeros(ROWS, 9), t, qr, qp, LAY, 1.0, backend=backend)
    with pytest.raises(IndexError, match="table: slot 99"):
        K.index_scores(q, w, keys, torch.tensor([[4, 99]]), qr, qp, LAY, 1.0, backend=backend)
    lat, sel = torch.zeros(ROWS, 8), torch.tensor([[4, -1], [5, 6]])
    with pytest.raises(ValueError, match="value_dims must be an int in"):
        K.sparse_mla_attention(q, lat, sel, LAY, 1.0, 9, backend=backend)
    with pytest.raises(ValueError, match="slots: rows"):
        K.sparse_mla_attention(q, lat, sel[:1], LAY, 1.0, 6, backend=backend)
    with pytest.raises(IndexError, match="slots: slot 30"):
        K.sparse_mla_attention(q, lat, torch.tensor([[4, 30], [5, 6]]), LAY, 1.0, 6, backend=backend)
    with pytest.raises(TypeError, match="slots must be int32 or int64"):
        K.sparse_mla_attention(q, lat, sel.float(), LAY, 1.0, 6, backend=backend)
    with pytest.raises(TypeError, match="lses must be float32"):
        K.merge_lse(torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, dtype=torch.float16), backend=backend)
    with pytest.raises(ValueError, match="lses of shape"):
        K.merge_lse(torch.zeros(2, 2, 4, 8), torch.zeros(3, 2, 4), backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_misuse_writes_nothing(backend):
    buf = torch.zeros(12, 2, 4)
    ok = dict(buffer=buf, values=torch.ones(2, 2, 4), slots=torch.tensor([0, 1]), layout=LAY, rank=0)
    for over, exc, msg in [
        (dict(values=torch.ones(2, 2, 5)), ValueError, "values of shape"),
        (dict(values=torch.ones(3, 2, 4)), ValueError, "values of shape"),
        (dict(slots=torch.tensor([0.0, 1.0])), TypeError, "slots must be int32 or int64"),
        (dict(slots=torch.tensor([[0, 1]])), ValueError, "slots must have 1 axes"),
        (dict(buffer=torch.zeros(13, 2, 4)), ValueError, "buffer: rows"),
        (dict(buffer=torch.zeros(12, 4, 2).transpose(1, 2)), ValueError, "trailing axes must be contiguous"),
        (dict(values=torch.ones(2, 2, 4, dtype=torch.int32)), TypeError, "values must be float"),
        (dict(rank=2), ValueError, "rank=2 is not a rank"),
    ]:
        with pytest.raises(exc, match=msg):
            K.store(**{**ok, **over, "backend": backend})
    assert not buf.any()


def test_bfloat16_is_gpu_only_in_the_interpreter():
    q = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    kv = torch.zeros(ROWS, 2, 8, dtype=torch.bfloat16)
    args = (q, kv, kv, torch.tensor([[4]]), torch.tensor([0]), torch.tensor([0]), LAY, 1.0)
    with pytest.raises(TypeError, match="bfloat16 is GPU-only"):
        K.paged_attention(*args, backend="triton")
    assert K.paged_attention(*args, backend="torch")[0].dtype == torch.bfloat16


def test_without_triton_the_triton_backend_raises_and_torch_works(monkeypatch):
    monkeypatch.setitem(sys.modules, "cpkv.kernels.triton_backend", None)  # import now fails
    monkeypatch.delattr(K, "triton_backend", raising=False)
    monkeypatch.delitem(K._BOUND, "triton", raising=False)  # bound once: forget it for this test
    with pytest.raises(RuntimeError, match="backend 'triton' needs the triton package"):
        K.get("triton")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        K.get("cuda")
    with pytest.raises(RuntimeError, match="backend 'triton' needs the triton package"):
        K.merge_lse(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1), backend="triton")
    assert K.get("auto", "cuda") is K.get("torch")  # auto falls back to torch
    out = K.get("auto").merge(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1))
    assert out[1].item() == 0.0


def test_the_interpreter_is_set_before_transformers_imports_triton():
    """``import cpkv`` sets nothing; on a machine without CUDA, importing :mod:`cpkv.models` sets
    ``TRITON_INTERPRET=1`` (through :mod:`cpkv.kernels`, the one place) and imports no triton, and only
    :mod:`cpkv.models` imports ``transformers`` (which imports triton): so triton, imported after, runs the
    triton backend on CPU tensors."""
    src = Path(K.__file__).resolve().parents[1]
    outside = [str(p.relative_to(src)) for p in src.rglob("*.py")
               if re.search(r"^\s*(from|import) transformers\b", p.read_text(), re.M) and p.parent.name != "models"]
    assert not outside, f"transformers imported outside cpkv.models: {outside}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """if True:
        import os, sys, torch
        import cpkv
        assert "TRITON_INTERPRET" not in os.environ, "import cpkv set it"
        import cpkv.models
        assert "triton" not in sys.modules and "transformers" not in sys.modules
        import triton.language  # as transformers' Llama does
        import cpkv.kernels as K
        if not torch.cuda.is_available():
            out, lse = K.merge_lse(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1), backend="triton")
            assert torch.equal(out, torch.zeros(1, 1, 4))
        print(torch.cuda.is_available(), os.environ.get("TRITON_INTERPRET"))"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == (["True", "None"] if torch.cuda.is_available() else ["False", "1"])


def test_a_backend_is_bound_once():
    """get() hands out one instance per backend: a forward takes it once, per batch, with no checks to rerun."""
    assert K.get("triton") is K.get("triton") and K.get("torch") is K.get("auto") is K.get("auto", "cpu")
    assert K.get("triton").name == "triton" and K.get("torch").name == "torch"
