"""``cpkv bench kvdtype``: bytes of each kv dtype measured on the same trace,
the DSA goal (fp8 at most 0.57x bf16 at DeepSeek's cache shapes), and the
accuracy rows exact by the one definition of :mod:`cpkv.engine.exactness`
(stored values roundings of the reference's, the reference at the run's
values and selection within 1e-4), whatever the CPU's kernels.
[[RFC-0001:C-KV-FORMAT]] [[RFC-0001:C-EXACTNESS]]"""

import pytest

from cpkv.engine.exactness import TOLERANCE
from cpkv.models import build_adapter
from cpkv.tools.bench.kvdtype import _accuracy_rows, bench_kvdtype, bench_model, format_kvdtype
from support.engine_checks import other_row, perturb_first_stored, scale_off


def test_kvdtype_bench_measures_the_dsa_goal_and_exact_accuracy_rows():
    r = bench_kvdtype(("bfloat16", "fp8"), cp=2, models=("deepseek-v3.2",), traces=("multiturn",))
    bf16, fp8 = r["bytes"]
    assert (bf16["kv dtype"], fp8["kv dtype"]) == ("bfloat16", "fp8")
    assert fp8["bytes/token"] == 3 * (656 + 132) and bf16["bytes/token"] == 3 * (1152 + 256)  # 3 layers
    assert r["dsa_fp8_vs_bf16"] == fp8["peak KV/rank"] / bf16["peak KV/rank"] <= 0.57
    assert fp8["vs bfloat16"] == " / ".join(f"{(656 + 132) / (1152 + 256):.3f}" for _ in range(3))
    for row in r["accuracy"]:
        assert row["exact"] == "yes", row
        assert float(row["max |dlogit| vs ref"]) < TOLERANCE and row["greedy = ref"] == row["requests"]
        flips, values = map(int, row["flips / values"].split(" / "))
        ties, selections = map(int, row["near-ties / selections"].split(" / "))
        assert values > 0 and 0 <= flips < values / 100 and selections > 0 and 0 <= ties < selections / 10
    assert "goal <= 0.57: met" in format_kvdtype(r)


@pytest.mark.parametrize("change", [scale_off, other_row], ids=["fp8-scale", "latent-row"])
def test_an_accuracy_row_with_one_wrong_stored_latent_is_not_exact(monkeypatch, change):
    """The row of the test above, with one stored FP8 latent scale 10% off or
    one latent row another token's: not exact, and why."""
    done = perturb_first_stored(monkeypatch, "latent", change)
    (row,) = _accuracy_rows("deepseek-v3.2", build_adapter(bench_model("deepseek-v3.2")), ("fp8",), 2, ("multiturn",))
    assert done == ["latent"] and "stored values are no rounding of the reference's" in row["exact"]
