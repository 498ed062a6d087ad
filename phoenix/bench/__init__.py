"""Benchmarks: ``phx bench`` and its sub-benchmarks, measured beside references of the same run.

Benchmark side, control plane. What lives here:

* ``throughput.py``  ``phx bench``: file <-> device memory against raw O_DIRECT, the naive
  staging loop, KvikIO and the pinned host -> device copy; table, JSON, PNG
  (``throughput_cli.py`` its options and their checks, ``report.py`` the table and plot).
* ``kvtrace/``       ``phx bench kv-trace``: an agentic KV-cache trace replayed through
  DRAM-only, staged-SSD and phoenix tiers (TTFT, QPS).
* ``loader.py``      ``phx bench loader``: phxloader against safetensors, fastsafetensors
  (``loader_peers.py``) and raw O_DIRECT; with ``--fast-device``, on a loop device over RAM.
* ``fastdev.py``     ``--fast-device SIZE``: that loop device, set up and always torn down.
* ``raw.py`` + ``bench_raw.c``  the C references (``libphxbench.so``, a plain shared
  library of its own, loaded with ctypes), ``files.py`` the bench files (a file of the
  user's only read, the bench's own marked, locked, removed after a failed run) and the
  page cache, ``args.py`` the checks of option values and devices shared by the benches.
* ``cli.py``         hangs them all under ``phx bench``.

What must stay true: this package imports the library and is imported only by the CLI
(``phoenix.cli``); nothing in the core, the adapters or the vendors imports it, and no
benchmark symbol is compiled into the core. Every figure is printed beside its reference
measured in the same run, at the same concurrency, on the same file. This file imports
nothing, so that loading one bench does not load the others.
"""
