"""``phx bench [kv-trace | loader | loadlat]``: the benchmarks' command line, hung under ``phx``.

Benchmark side, control plane. ``phx bench`` alone is the throughput bench; the
sub-benchmarks are its subcommands. Called by phoenix.cli.phx, the only importer of
this package.
"""

from __future__ import annotations

from phoenix.cli._run import add_subcommands

from . import kvtrace, loader, loadlat, throughput


def add_parser(sub) -> None:
    p = throughput.add_parser(sub)  # the throughput bench's options: refused before a subcommand
    benches = add_subcommands(p, dest="bench_cmd", metavar="{kv-trace,loader,loadlat}")
    kvtrace.add_parser(benches)
    loader.add_parser(benches)
    loadlat.add_parser(benches)
