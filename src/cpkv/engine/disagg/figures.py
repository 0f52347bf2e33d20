"""The figures of a disaggregated run: the report world rank 0 returns, and its table."""

from __future__ import annotations

import numpy as np

from ..config import DisaggConfig
from ..records import outputs
from .control import DisaggControl


def disagg_report(cfg: DisaggConfig, ctl: DisaggControl, ranks: list[dict], seconds: float,
                  checked: dict | None) -> dict:
    """The run's figures: ``bytes_per_pair[a][b]`` is the KV bytes prefill
    rank ``a`` sent decode rank ``b`` over the run (as planned; the senders'
    and receivers' own counts are ``sent_bytes_per_pair`` and
    ``received_bytes_per_pair``), ``transfer_seconds`` the longest time a
    decode rank spent receiving and writing transferred KV."""
    M, N = cfg.prefill_size, cfg.decode_size
    sent, received = np.zeros((M, N), dtype=np.int64), np.zeros((M, N), dtype=np.int64)
    for x in ranks:
        for peer, n in x["bytes"].items():
            if x["side"] == "prefill":
                sent[x["group_rank"], peer] += n
            else:
                received[peer, x["group_rank"]] += n
    P, D = ctl.prefill.stats, ctl.decode.stats
    dec = [x for x in ranks if x["side"] == "decode"]
    return {
        "config": cfg.public(),
        "prefill_ranks": M, "decode_ranks": N, "prefill_page": cfg.page_size, "decode_page": cfg.d_page,
        "units": sorted(ctl.units),
        "kv_dtype": cfg.kv_dtype,
        "kv_bytes_per_token": ctl.slot_bytes,
        "requests": len(ctl.decode.requests),
        "finished": D.finished,
        "steps": D.steps,
        "prefill_requests": len(ctl.prefill.requests),
        "prefill_prompt_tokens": P.prompt_tokens,
        "prefill_computed_tokens": P.computed_tokens,
        "prefill_hit_rate": P.hit_tokens / max(P.prompt_tokens, 1),
        "prefill_host_hit_tokens": P.host_hit_tokens,
        "prefill_backup_pages": P.backup_pages,
        "decode_hit_tokens": D.hit_tokens,
        "decode_computed_tokens": D.computed_tokens,
        "computed_tokens": P.computed_tokens + D.computed_tokens,
        "generated_tokens": D.generated_tokens,
        "preemptions": {"prefill": P.preemptions, "decode": D.preemptions},
        "evicted_pages": {"prefill": P.evicted_pages, "decode": D.evicted_pages},
        "transfers": ctl.transfers,
        "transferred_tokens": D.arrived_tokens,
        "messages": int(ctl.pair_messages.sum()),
        "messages_per_pair": ctl.pair_messages.tolist(),
        "bytes_per_pair": (ctl.pair_slots * ctl.slot_bytes).tolist(),
        "sent_bytes_per_pair": sent.tolist(),
        "received_bytes_per_pair": received.tolist(),
        "bytes_moved": int(ctl.pair_slots.sum() * ctl.slot_bytes),
        "transfer_seconds": max((x["transfer_seconds"] for x in dec), default=0.0),
        # each step of decodes' split on the decode group (its rank 0's count: every rank runs the same)
        "decode_splits": dec[0]["decode_splits"] if dec else {},
        "transfer_seconds_per_rank": [x["transfer_seconds"] for x in ranks],
        "plan_digests": [x["digest"] for x in ranks],
        "seconds": seconds,
        "tokens_per_second": D.generated_tokens / max(seconds, 1e-9),
        "check": checked,
        "outputs": outputs(ctl.decode.requests),
        "sequences": [(list(r.prompt), r.spec.max_new_tokens) for r in ctl.decode.requests],
    }


def format_disagg(r: dict) -> str:
    """Human-readable summary of a disaggregated run: the bytes-per-pair table and the transfer time."""
    M, N = r["prefill_ranks"], r["decode_ranks"]
    lines = [f"prefill group {M} ranks (page {r['prefill_page']}) -> decode group {N} ranks (page {r['decode_page']}),"
             f" by {'/'.join(r['units']) or 'nothing'}; KV in {r['kv_dtype']}, {r['kv_bytes_per_token']:,} bytes a token",
             f"{r['finished']}/{r['requests']} requests, {r['steps']} steps, {r['transfers']} transfers, "
             f"{r['transferred_tokens']} tokens moved in {r['messages']} messages, {r['bytes_moved']:,} bytes, "
             f"transfer time {r['transfer_seconds'] * 1e3:.1f} ms",
             f"prefix caches: prefill side {100 * r['prefill_hit_rate']:.1f}% of prompt tokens hit "
             f"({r['prefill_host_hit_tokens']} from its host tier), decode side {r['decode_hit_tokens']} tokens "
             f"already there (not moved); preemptions prefill {r['preemptions']['prefill']}, decode "
             f"{r['preemptions']['decode']}",
             *([f"decode group's forwards of decodes by split (decode split {r['config']['decode_split']}): "
                + ", ".join(f"{k} {v}" for k, v in sorted(r["decode_splits"].items()))] if r.get("decode_splits") else []),
             "KV bytes sent, prefill rank (rows) -> decode rank (columns):",
             "      " + "".join(f"{'d' + str(b):>12}" for b in range(N))]
    for a in range(M):
        lines.append(f"{'p' + str(a):>6}" + "".join(f"{v:>12,}" for v in r["bytes_per_pair"][a]))
    c = r.get("check")
    if c:
        lines.append(f"check: {c['requests_matched']}/{c['requests']} requests' greedy tokens equal transformers', "
                     f"{c['logits_checked']} logits within {c['max_abs_diff']:.2e}")
        a = c.get("agreement")
        if a:
            lines.append(f"stored values: {a['flips']} rounding flips, {a['outside']} outside, of {a['values']}"
                         + (f"; selections: {a['near_ties']} near-ties, {a['mismatches']} mismatches, of {a['rows']}"
                            if a["rows"] else ""))
        u = c.get("unquantized")
        if u and r["kv_dtype"] != "float32":
            lines.append(f"vs the unquantized model: max logit difference {u['max_abs_diff']:.3g}, greedy tokens "
                         f"equal for {u['greedy_agreement']}/{c['requests']} requests")
    return "\n".join(lines)


