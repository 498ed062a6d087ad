"""`phx bench` end to end on the host vendor (a test double), small: every op, the
record fields the I/O issue asks for, ratios against the raw figure of the same run,
the random reads interleaved with their repetitions kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REQUIRED = {"op", "impl", "vendor", "warm", "gbps", "cpu_s_per_gb", "threads", "chunk", "size"}


def test_phx_bench_records(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PHX_VENDOR="host")
    cmd = [sys.executable, "-P", "-m", "phoenix.cli.phx", "bench", "--file", str(tmp_path / "b.bin"), "--size", "32M",
           "--chunk", "4M", "--threads", "2", "--ops", "read,write,randread", "--temperature", "cold,warm",
           "--reps", "2", "--random-ops", "400", "--quiet", "--json", str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = json.loads(out.read_text())
    for r in recs:
        assert REQUIRED <= r.keys(), r
        assert r["vendor"] == "host" and r["test_double"] is True
        assert r["gbps"] > 0 and r["size"] > 0
    have = {(r["op"], r["impl"], r["warm"]) for r in recs if not r.get("first")}
    for want in [("read", "raw_odirect", False), ("read", "naive", False), ("read", "phoenix", False),
                 ("write", "raw_odirect", False), ("write", "phoenix", False), ("read", "raw_buffered", True),
                 ("read", "phoenix", True), ("randread", "raw_odirect", False), ("randread", "phoenix", False),
                 ("randread", "phoenix_batch", False)]:
        assert want in have, (want, sorted(have))
    for r in recs:
        if r["op"] == "randread":
            assert r["size"] == 64 * 16 * 65536 and len(r["runs_s"]) == 2 and r["iops"] > 0  # at least qd x 16 reads
    assert "test double" in p.stdout and "randread" in p.stdout
