"""Reports of an engine run: the text table and the occupancy plot."""

from __future__ import annotations

from .table import format_rows


def save_figure(fig, path: str) -> None:
    """Write ``fig`` to ``path`` whole or not at all: into a hidden file beside it, then renamed over it, so a
    run stopped while it writes (Ctrl-C, a full disk) leaves no partial file; the figure is closed either way."""
    import os
    import tempfile
    from pathlib import Path

    import matplotlib.pyplot as plt

    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format=p.suffix.lstrip(".").lower())
        os.replace(tmp, p)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        plt.close(fig)


def format_outputs(outputs: list[dict]) -> str:
    """``--print-tokens``: one line a request, its id, prompt length and generated token ids."""
    lines = ["", "generated tokens (id, prompt tokens: ids):"]
    return "\n".join(lines + [f"{o['id']} {o['prompt_tokens']}: {' '.join(map(str, o['generated']))}" for o in outputs])


def format_engine(r: dict) -> str:
    """The human-readable report of one ``cpkv run`` (the engine)."""
    c = r["config"]
    m = c["model"]
    kib = lambda b: f"{b / 1024:.1f} KiB"  # noqa: E731
    peak = r["peak_kv_bytes_per_rank"]
    rep = max(r["peak_replicated_kv_bytes"], 1)
    ranks = [{"rank": x["rank"], "peak KV": kib(p), "share of replicated": round(p / rep, 3),
              "tokens computed": x["tokens_computed"], "context read": x["kv_read"],
              "bytes received": x["moved_bytes"], "slots copied": x["copied"], "backed up": x["backed_up"],
              "loaded": x["loaded"]} for x, p in zip(r["ranks"], peak)]
    ck = r["check"]
    rows = [
        ("requests", f"{r['finished']} of {r['requests']} finished in {r['steps']} steps"),
        ("prompt / generated tokens", f"{r['prompt_tokens']} / {r['generated_tokens']}"),
        ("prefix hit rate: device / host", f"{r['device_hit_rate']:.3f} / {r['host_hit_rate']:.3f}"),
        ("mid-page copies", r["mid_page_copies"]),
        ("chunked prefill: continuations (mid-page)", f"{r['chunk_continuations']} ({r['mid_page_continuations']})"),
        ("evicted pages", r["evicted_pages"]),
        ("host backups: pages / bytes", f"{r['backup_pages']} / {r['backup_bytes']}"),
        ("host loads: pages / bytes", f"{r['load_pages']} / {r['load_bytes']}"),
        ("preemptions / refused allocations", f"{r['preemptions']} / {r['refusals']}"),
        ("KV dtype, bytes a token (all layers)", f"{r['kv_dtype']}, {r['kv_bytes_per_token']}"),
        ("peak KV per rank vs a replicated cache", f"{kib(max(peak))} vs {kib(rep)} "
                                                   f"({max(peak) / rep:.3f} of it)"),
        ("max lane gap", f"{r['max_lane_gap_pct']:.2f} % of a lane"),
        ("generated tokens per second", f"{r['tokens_per_second']:.1f} ({r['seconds']:.2f} s)"),
    ]
    if r.get("decode_splits"):
        rows += [("forwards of decodes by split", ", ".join(f"{k} {v}" for k, v in sorted(r["decode_splits"].items())))]
    rows += latency_rows(r.get("latency"))
    if r.get("kernels_fallback"):
        rows += [("kernels fallback", r["kernels_fallback"])]
    if ck is not None:
        ref = "transformers" if r["kv_dtype"] == "float32" else f"transformers, {r['kv_dtype']} cache"
        rows += [(f"max |logit - {ref}|", f"{ck['max_abs_diff']:.3g} over {ck['logits_checked']} logits"),
                 ("requests matching greedy decoding", f"{ck['requests_matched']} of {ck['requests']}")]
        a = ck.get("agreement")
        if a:
            rows += [("stored values: rounding flips / outside", f"{a['flips']} / {a['outside']} of {a['values']}")]
            if a["rows"]:
                rows += [("selections: near-ties / mismatches",
                          f"{a['near_ties']} / {a['mismatches']} of {a['rows']}")]
        u = ck.get("unquantized")
        if u and r["kv_dtype"] != "float32":
            rows += [("vs unquantized: max |logit diff| / greedy agreement",
                      f"{u['max_abs_diff']:.3g} / {u['greedy_agreement']} of {ck['requests']} requests")]
    width = max(len(k) for k, _ in rows)
    head = (f"CP group of {c['cp_size']} ranks, {c.get('kv', 'shared')} KV, page {c['page_size']}, {c['device_pages']} device pages per rank, "
            f"{c['host_pages']} host pages; {m['family']} ({m.get('layers', '?')} layers), {c['workload']} trace, "
            f"chunk {c['chunk']}, prefill split {c['prefill_split']}, decode split {c['decode_split']}, "
            f"device {c.get('device', 'cpu')}, kernels {c.get('kernels', 'torch')}")
    return "\n".join([head, "", *(f"{k.ljust(width)}  {v}" for k, v in rows), "",
                      format_rows(ranks, "per rank:")])


def latency_rows(lat: dict | None) -> list[tuple[str, str]]:
    """The TTFT and TPOT rows of a report (p50 / p99, steps and milliseconds); none without figures."""
    if not lat:
        return []
    out = []
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
        st, sec = lat[f"{key}_steps"], lat[f"{key}_s"]
        if st["count"]:
            out.append((f"{name} p50 / p99 ({st['count']} requests)",
                        f"{st['p50']:.1f} / {st['p99']:.1f} steps, {1e3 * sec['p50']:.1f} / {1e3 * sec['p99']:.1f} ms"))
    return out


def plot_engine(r: dict, path: str) -> None:
    """Device pages used per lane and host pages used, over the steps of a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    occ = np.array(r["occupancy"])
    host = np.array(r["host_occupancy"])
    c = r["config"]
    panels = 2 if host.size else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.0 * panels, 3.2), squeeze=False)
    ax = axes[0][0]
    for lane in range(occ.shape[1]):
        ax.plot(occ[:, lane], linewidth=0.8, label=f"lane {lane}")
    ax.axhline(c["device_pages"], color="black", linestyle=":", linewidth=0.8)
    ax.set_title(f"device pages used per lane (max gap {r['max_lane_gap_pct']:.1f} %)", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.legend(fontsize=6)
    if host.size:
        ax = axes[0][1]
        ax.plot(host, color="tab:purple", linewidth=0.8)
        ax.axhline(c["host_pages"], color="black", linestyle=":", linewidth=0.8)
        ax.set_title(f"host pages used (hit rate {r['host_hit_rate']:.2f})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
