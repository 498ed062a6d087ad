"""``phx bench kv-trace``: replay an agentic KV-cache trace through DRAM-only, staged-SSD, KvikIO and phoenix tiers.

Benchmark side (control plane): this package imports the library, the library never imports it.
What is real and what is simulated:

* **Real**: device memory of the selected vendor (the HBM tier), pinned host memory from
  the vendor runtime (the DRAM tier), a slab file (the SSD tier) read through phoenix
  (``phoenix``), through KvikIO in compat mode (``kvikio``: its ``CuFile.pread`` into a CuPy
  view of the HBM block, in its thread pool; ``kvikio_io``) or through the naive staged loop
  (``staged``: ``pread`` into pinned host memory, then a synchronous host->device copy),
  the host<->device copies of promotion and
  demotion, the writes of evicted blocks, and the prefill compute: matrix products and
  attention of the model's shape for every uncached token (torch on cuda, else CuPy, on a
  GPU; NumPy on the CPU with the host vendor, a CPU stand-in).
* **Simulated**: the sessions (a seeded trace with the published statistics of Codex runs on
  SWE-bench Pro, or a trace file), think time between rounds (compressed by
  ``--time-scale``), token counts (``--token-scale``), the model (no weights, no tokens: the
  products have its shape; one layer's weight matrices serve every layer), KV contents (a
  verification pattern per block, not KV values), decode (not run: its tokens' KV is written
  as if produced).

Tiers (blocks of ``--block-tokens`` tokens; LRU in each tier; lower tiers are inclusive):

* a round needs the KV of its prefix's full blocks in HBM; each is an HBM hit, a load from
  DRAM (``memcpy_async`` host->device), a load from SSD, or missing. From the first missing
  block on, the prefix is recomputed (prefix caching needs a contiguous prefix), together
  with the new tokens; the linear layers run while the loads are in flight, attention over
  the context after they land (as an engine overlaps layer-wise loading).
* new KV is produced in HBM; a block evicted from HBM is copied to DRAM (unless already
  there), one evicted from DRAM is written to the SSD slab (``dram``: dropped, recomputed when
  needed again). Demotion runs on the path of the round that needs the space; phoenix and
  KvikIO start a round's writes together, and with ``--write-behind N`` (default 8) keep the N
  least recently used DRAM blocks written to the SSD tier ahead of their eviction in a writer
  thread (phoenix at ``priority="background"``; ``behind``), as an engine that offloads
  asynchronously does. The staged loop writes on eviction, one block after the other.

A point (configuration, concurrency) runs ``--duration`` seconds and, with ``--min-samples N``,
until it has N TTFTs (at most ``--max-duration``); its p99 TTFT comes with a percentile-bootstrap
95 % interval, and each configuration's limit (most sessions under the threshold) is given by
the p99 and by the interval's upper bound. ``--stop-over F`` skips a configuration's higher
concurrencies once its p99 is certainly over F x the threshold; ``--fast-device`` puts the
slab on a loop device over RAM.

Every loaded byte is checked against its block's pattern after the round's TTFT is taken
(untimed); destinations are poisoned before each load so that a load that does not land is
caught. ``hbm_hits + dram_loads + ssd_loads + recomputes == blocks_needed`` for every round.

Trace file (JSON lines, ``write_trace``/``read_trace``): a header line
``{"format": "phx-kv-trace", "version": 1, "params": {...}}`` then one line per round
``{"session": id, "round": r, "think_s": s, "input_tokens": C, "prefix_tokens": P,
"output_tokens": O}``: ``C`` is the round's whole prompt, ``P`` (at most the previous round's
``C + O``) how many of its leading tokens equal the previous round's context (the rest is
new: tool results, user turns, or edited context), ``think_s`` the gap before the round in
seconds (after the previous round's first token). ``prefix_tokens`` may be omitted (taken as
the whole previous context); other keys are ignored.

Modules: ``trace`` (generator, reader, writer, statistics), ``compute`` (geometry, block
patterns, prefill backends), ``tiers`` (HBM / DRAM / SSD index and slab files), ``kvikio_io``
(the kvikio configuration's engine), ``replay`` (the sessions' rounds, timed), ``report``
(bootstrap interval, limits, table, plots), ``cli`` (options, the sweep, ``gen`` and ``plot``).
"""

from .cli import add_parser, apply_dry_run, main, main_gen, main_plot, run
from .compute import Geometry, block_key, make_backend
from .replay import CONFIGS, Replayer
from .report import best_concurrency, bootstrap_ci, concurrency_limits, plot, plot_tiers, table
from .trace import FORMAT, VERSION, Round, Session, Trace, generate, read_trace, scale_trace, trace_stats, write_trace

__all__ = [
    "CONFIGS",
    "FORMAT",
    "VERSION",
    "Geometry",
    "Replayer",
    "Round",
    "Session",
    "Trace",
    "add_parser",
    "apply_dry_run",
    "best_concurrency",
    "block_key",
    "bootstrap_ci",
    "concurrency_limits",
    "generate",
    "main",
    "main_gen",
    "main_plot",
    "make_backend",
    "plot",
    "plot_tiers",
    "read_trace",
    "run",
    "scale_trace",
    "table",
    "trace_stats",
    "write_trace",
]
