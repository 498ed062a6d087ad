"""``phx bench kv-trace`` reporting: p99 TTFT and its bootstrap interval, each configuration's
concurrency limit, the table and the plots (one run, or one panel column per storage tier).

Benchmark side, control plane: it reads records (dicts, as ``--json`` writes them), never the
library. A record with a ``skipped`` key is a point that was not run (``--stop-over``): it is
listed in the table as such and left out of the plots and the limits.
"""

from __future__ import annotations

import math
import textwrap

#: the configurations in the order they run, are listed and are plotted
CONFIGS = ("dram", "staged", "kvikio", "phoenix")

#: one color per configuration, the same in every panel and every plot
COLORS = {"dram": "tab:gray", "staged": "tab:orange", "kvikio": "tab:green", "phoenix": "tab:blue"}

#: the tiers below HBM each configuration loads from
TIERS = {"dram": ("dram",), "staged": ("dram", "ssd"), "kvikio": ("dram", "ssd"), "phoenix": ("dram", "ssd")}

MPL_MISSING = "matplotlib is not installed: pip install matplotlib (or pip install 'phoenix-direct-storage[bench]')"

BOOTSTRAP_RESAMPLES = 2000


# ---- statistics --------------------------------------------------------------------------------


def pct(xs: list, q: float):
    """The nearest-rank ``q`` quantile of the sorted ``xs`` (None when empty): the value below
    which ``q`` of the samples lie, one of the samples (p99 of 200 samples: the 198th)."""
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def bootstrap_ci(
    samples, q: float = 0.99, resamples: int = BOOTSTRAP_RESAMPLES, level: float = 0.95, seed: int = 0
) -> list[float] | None:
    """A percentile-bootstrap ``level`` confidence interval ``[lo, hi]`` of the nearest-rank
    ``q`` quantile of ``samples``: ``resamples`` resamples with replacement (a seeded numpy
    generator; vectorized, in row blocks of at most ~4M draws), the quantile of each, and
    the ``(1-level)/2`` and ``(1+level)/2`` quantiles of those. With few samples the
    resampled p99 can sit on one side of the sample's own; the interval is then widened to
    contain it, so that ``lo <= p99 <= hi`` always holds. None for no samples."""
    import numpy as np

    x = np.asarray(samples, dtype=np.float64)
    n = int(x.size)
    if n == 0:
        return None
    k = min(n - 1, max(0, math.ceil(q * n) - 1))
    point = float(np.partition(x, k)[k])
    rng = np.random.default_rng(seed)
    est = np.empty(resamples)
    rows = max(1, min(resamples, 4_000_000 // n))
    for i in range(0, resamples, rows):
        m = min(rows, resamples - i)
        draw = x[rng.integers(0, n, size=(m, n))]
        est[i : i + m] = np.partition(draw, k, axis=1)[:, k]
    a = (1.0 - level) / 2
    lo, hi = np.quantile(est, [a, 1.0 - a])
    return [min(float(lo), point), max(float(hi), point)]


# ---- limits --------------------------------------------------------------------------------------


def _measured(records: list[dict]) -> list[dict]:
    return [r for r in records if not r.get("skipped")]


def best_concurrency(records: list[dict]) -> dict:
    """Per config: the most concurrent sessions with p99 TTFT under the threshold (0: none)."""
    out: dict = {}
    for r in records:
        out.setdefault(r["config"], 0)
        if not r.get("skipped") and r["under_threshold"]:
            out[r["config"]] = max(out[r["config"]], r["concurrency"])
    return out


def concurrency_limits(records: list[dict]) -> dict:
    """Per config, the most concurrent sessions under the threshold, two ways:

    * ``p99``: the p99 TTFT (the point estimate) under it (:func:`best_concurrency`);
    * ``certain``: the whole 95 % bootstrap interval of the p99 under it (its upper bound),
      the limit that the samples establish (None where the records carry no interval).

    ``top``: that config's limit is the largest concurrency it was measured at, so the real
    limit may lie beyond the grid."""
    out: dict = {}
    for cfg, n in best_concurrency(records).items():
        mine = [r for r in _measured(records) if r["config"] == cfg]
        sure = [r for r in mine if r.get("ttft_p99_ci_s")]
        certain = (
            max((r["concurrency"] for r in sure if r["ttft_p99_ci_s"][1] < r["threshold_s"]), default=0)
            if sure
            else None
        )
        top = max((r["concurrency"] for r in mine), default=0)
        out[cfg] = {"p99": n, "certain": certain, "top": bool(mine) and n == top}
    return out


def limits_text(records: list[dict]) -> str:
    thr = next((r["threshold_s"] for r in records), 0)
    parts = []
    for cfg, lim in concurrency_limits(records).items():
        cert = "" if lim["certain"] is None else f" [{lim['certain']}]"
        parts.append(f"{cfg} {lim['p99']}{'+' if lim['top'] else ''}{cert}")
    return (
        f"most concurrent sessions with p99 TTFT < {thr:g} s [with the 95% CI's upper bound under it too]: "
        + ", ".join(parts)
    )


# ---- table ---------------------------------------------------------------------------------------


def round_phases(rec: dict) -> str:
    """Where a point's mean TTFT went: room in HBM, demotions, loads (the linear layers
    queued beside them), the rest (attention, the produced blocks), and the rate of a
    round's loads while they ran."""
    n, rounds = rec["counts"], max(1, rec["rounds"])
    parts = [f"{k} {n.get(k + '_s', 0.0) / rounds:.3f} s" for k in ("wait", "demote", "load", "compute")]
    loaded = n.get("bytes_loaded_dram", 0) + n.get("bytes_loaded_ssd", 0)
    if n.get("load_s"):
        parts.append(f"loads at {loaded / n['load_s'] / 1e9:.2f} GB/s in a round")
    if n.get("written_to_ssd"):
        parts.append(f"{n.get('written_behind', 0)} of {n['written_to_ssd']} SSD writes ahead of eviction")
    if n.get("written_behind"):
        parts.append(f"{n.get('ssd_loads_behind', 0)} of {n.get('ssd_loads', 0)} SSD loads from them")
    if rec.get("cpu_s_per_gb") is not None:
        parts.append(f"CPU {rec['cpu_s']:.1f} s ({rec['cpu_s_per_gb']:.3f} s per GB loaded or written)")
    return ", ".join(parts)


def tier_warnings(rec: dict) -> list[str]:
    """The tiers of ``rec``'s configuration it loaded nothing from: such a point does not
    measure that tier's path (the SSD one, for staged, kvikio and phoenix, is the point of the bench)."""
    c = rec["counts"]
    empty = [t for t in TIERS.get(rec["config"], ()) if c.get(f"{t}_loads", 0) == 0]
    if not empty:
        return []
    names = " and ".join(t.upper() for t in empty)
    tiers, paths = ("tier", "that path") if len(empty) == 1 else ("tiers", "those paths")
    return [
        f"{rec['config']} at concurrency {rec['concurrency']} loaded nothing from the {names} {tiers}: the point "
        f"does not measure {paths}; more sessions (--concurrency), smaller --hbm / --dram or a longer --duration "
        "make it load"
    ]


def sample_warnings(rec: dict) -> list[str]:
    """A point that ended with fewer TTFT samples than ``--min-samples`` asked for."""
    if not rec.get("samples_short"):
        return []
    why = {
        "max_duration": f"--max-duration {rec.get('max_duration_s', 0):g} s passed first",
        "trace_end": "the trace ran out of sessions (more --sessions)",
    }.get(rec.get("stopped_by"), "it stopped early")
    return [
        f"{rec['config']} at concurrency {rec['concurrency']} has {rec['samples']} TTFT samples, fewer than "
        f"--min-samples {rec['min_samples']}: {why}; its p99 and interval rest on fewer samples"
    ]


LEGEND = """\
columns:
  config    dram: KV evicted from DRAM is dropped and recomputed; staged: the SSD tier read by pread into pinned
            host memory and a synchronous copy (the naive loop); kvikio: the SSD tier read by KvikIO (compat mode,
            its thread pool) into device memory; phoenix: the SSD tier read through phoenix
  conc      concurrent sessions
  rounds    rounds (requests) that reached their first token in the point (the TTFT samples)
  QPS       rounds per second
  TTFT      time to first token of a round, in seconds (loads of its cached prefix + prefill of the rest):
            mean, p50 (median), p99
  95% CI    percentile-bootstrap 95% confidence interval of the p99 (2000 resamples of the rounds' TTFTs)
  hbm       blocks of the rounds' prefixes already in HBM (device memory)
  dram      blocks loaded from DRAM (pinned host memory)
  ssd       blocks loaded from the SSD tier (the slab file)
  recomp    blocks recomputed (not cached, or after the first missing one)
  GB ld     GB (10^9 bytes) loaded into HBM from DRAM and SSD
  verified  every loaded block matched its pattern (yes) or not (NO)
limits: N+ = under the threshold at the largest concurrency measured (the limit may lie beyond);
        [N] = the most sessions whose p99 interval lies wholly under the threshold"""


def table(records: list[dict]) -> str:
    def f(x):
        return f"{x:.3f}" if x is not None else "-"

    lines = [
        f"{'config':<8} {'conc':>4} {'rounds':>6} {'QPS':>7} {'TTFT mean':>9} {'p50':>7} {'p99':>7} {'95% CI':>13}  "
        f"{'hbm':>5} {'dram':>5} {'ssd':>5} {'recomp':>6} {'GB ld':>7} {'verified':>8}"
    ]
    for r in records:
        if r.get("skipped"):
            lines.append(f"{r['config']:<8} {r['concurrency']:>4}   not run: {r['skipped']}")
            continue
        c = r["counts"]
        ci = r.get("ttft_p99_ci_s")
        cis = f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "-"
        lines.append(
            f"{r['config']:<8} {r['concurrency']:>4} {r['rounds']:>6} {r['qps']:>7.2f} {f(r['ttft_mean_s']):>9} "
            f"{f(r['ttft_p50_s']):>7} {f(r['ttft_p99_s']):>7} {cis:>13}  {c['hbm_hits']:>5} {c['dram_loads']:>5} "
            f"{c['ssd_loads']:>5} {c['recomputes']:>6} {(c['bytes_loaded_dram'] + c['bytes_loaded_ssd']) / 1e9:>7.2f} "
            f"{'yes' if r['verified'] else 'NO':>8}"
        )
    lines.append(limits_text(records))
    lines += ["", LEGEND]
    warned = [w for r in records for w in r.get("warnings", [])]
    lines += [f"WARNING: {w}" for w in warned]
    return "\n".join(lines)


# ---- plots ---------------------------------------------------------------------------------------


def plot(records: list[dict], path: str, title: str) -> str:
    """The one-run plot (``--plot``): :func:`plot_tiers` with one column; a message, not an
    error, where matplotlib is missing (the run's records are written all the same)."""
    try:
        return plot_tiers([("", records)], path, title)
    except ImportError:
        return MPL_MISSING + ": no plot written"


def column_title(name: str, records: list[dict], width: int = 48) -> str:
    """The records' label (else storage, else ``name``), wrapped at ``width`` characters so
    that side-by-side panels' titles do not run into each other."""
    r = next(iter(records), {})
    return textwrap.fill(r.get("label") or r.get("storage") or name, width)


def plot_tiers(runs: list[tuple[str, list[dict]]], path: str, title: str) -> str:
    """One panel column per run (a storage tier: titled by its records' label, else ``name``),
    rows p99 TTFT (log scale, 95% CI bars, the threshold) and QPS against concurrent sessions;
    one line per configuration in :data:`COLORS`. Points not run are absent. Raises
    ImportError (:data:`MPL_MISSING`) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(MPL_MISSING) from None
    from ..report import FONT, plain_log_axis

    with plt.rc_context({"font.size": FONT["base"], "xtick.labelsize": FONT["tick"], "ytick.labelsize": FONT["tick"]}):
        ncol = max(1, len(runs))
        width = max(9.0, 1.0 + 5.6 * ncol)
        fig, axes = plt.subplots(2, ncol, figsize=(width, 9.0), sharey="row", squeeze=False)
        concs = sorted({r["concurrency"] for _, recs in runs for r in recs})
        for j, (name, recs) in enumerate(runs):
            _panel(axes[0][j], axes[1][j], recs)
            axes[0][j].set_title(column_title(name, recs), fontsize=FONT["title"])
            for ax, yl in zip((axes[0][j], axes[1][j]), ("p99 TTFT (s)", "rounds per second (QPS)"), strict=True):
                plain_log_axis(ax, "x", concs)
                ax.set_xlabel("concurrent sessions")
                if j == 0:
                    ax.set_ylabel(yl)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=FONT["legend"])
            plain_log_axis(axes[0][j], "y", base=10)
        fig.suptitle(textwrap.fill(title, int(width * 9)), fontsize=FONT["suptitle"])
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return f"plot written to {path}"


def _panel(ax_t, ax_q, recs: list[dict]) -> None:
    measured = [r for r in _measured(recs) if r.get("ttft_p99_s") is not None]
    order = list(CONFIGS) + sorted({r["config"] for r in measured} - set(CONFIGS))
    limits = concurrency_limits(recs)
    for cfg in order:
        pts = sorted((r for r in measured if r["config"] == cfg), key=lambda r: r["concurrency"])
        if not pts:
            continue
        x = [r["concurrency"] for r in pts]
        p99 = [r["ttft_p99_s"] for r in pts]
        ci = [r.get("ttft_p99_ci_s") or [r["ttft_p99_s"]] * 2 for r in pts]
        err = [[p - c[0] for p, c in zip(p99, ci, strict=True)], [c[1] - p for p, c in zip(p99, ci, strict=True)]]
        lim = limits.get(cfg, {})
        unrun = [r["concurrency"] for r in recs if r["config"] == cfg and r.get("skipped")]
        lab = f"{cfg} (limit {lim.get('p99', 0)}{'+' if lim.get('top') else ''}"
        lab += f"; not run from {min(unrun)} on)" if unrun else ")"
        ax_t.errorbar(x, p99, yerr=err, marker="o", capsize=3, color=COLORS.get(cfg), label=lab)
        ax_q.plot(x, [r["qps"] for r in pts], marker="o", color=COLORS.get(cfg), label=cfg)
    if recs:
        thr = recs[0]["threshold_s"]
        ax_t.axhline(thr, color="gray", linestyle="--", label=f"threshold {thr:g} s")
