#!/usr/bin/env bash
# The GPU machine's check of the I/O stack's integrity (one call of the device tool):
#   tools/gpu_check.sh          with the working tree as the device tool sends it, .whl carried
# Builds phoenix there (no network: no build isolation, setuptools carried in .whl/), runs the
# conformance suite for `nvidia` (caller-stream ordering with torch and CuPy included), then
# interrupts phoenix's calls into CUDA device memory and host memory (tests/_interrupt_probe.py:
# every byte checked after each exception) and the interrupt tests of the host vendor on that
# machine's kernel. Everything worth keeping is written under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/phx-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/phx-site

t0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target "$SITE" . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "setup: $(($(date +%s) - t0)) s"
export PYTHONPATH=$SITE:/tmp/site PATH=$SITE/bin:$PATH
cd /tmp # (the installed package, not the source tree)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
PHX_VENDOR=nvidia phx info >"$OUT/phx-info.txt" 2>&1
grep -iE "^vendor|selected|nvidia" "$OUT/phx-info.txt" | head -5

echo "== conformance (nvidia)"
PHX_VENDOR=nvidia timeout 240 phx-port test nvidia --report-dir "$OUT/conformance" >"$OUT/conformance.log" 2>&1
echo "conformance rc=$?"
tail -8 "$OUT/conformance.log"

echo "== interrupted calls into CUDA memory (nvidia) and host memory"
mkdir -p /tmp/ip
: >"$OUT/probes.jsonl"
for engine in io_uring threads; do
    for spec in read_many:device:itimer write_many:device:thread read:device:kbd pread:device:itimer \
        batch_read:device:thread read_async:device:itimer write_async:device:itimer read_many:host:itimer; do
        IFS=: read -r kind mem src <<<"$spec"
        line=$(PHX_VENDOR=nvidia PHX_IO_ENGINE=$engine timeout 120 python3 "$REPO/tests/_interrupt_probe.py" "$kind" \
            --memory "$mem" --source "$src" --trials 20 --dir /tmp/ip 2>"$OUT/probe-err.txt" | tail -1)
        echo "{\"engine\": \"$engine\", \"probe\": ${line:-null}}" >>"$OUT/probes.jsonl"
        python3 - "$engine" "$line" <<'EOF'
import json, sys
engine, line = sys.argv[1], sys.argv[2]
try:
    d = json.loads(line)
except ValueError:
    print(f"{engine}: probe died: {line[:200]!r}")
    raise SystemExit
keys = ("interrupted", "stray", "garbage", "file_users", "engine_users", "other_thread_read", "live")
print(engine, d["kind"], d["memory"], d["source"], {k: d[k] for k in keys}, "other:", d["other"][:1])
EOF
    done
done

echo "== interrupt and fork tests (host vendor, this machine's kernel)"
rm -rf /tmp/phx-tests && cp -r "$REPO/tests" /tmp/phx-tests && cd /tmp/phx-tests # (outside the source tree)
timeout 400 python3 -m pytest -q -p no:cacheprovider test_interrupts.py test_fork_core.py \
    -k "storm or handler or exit or built or forked" >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
tail -5 "$OUT/pytest.log"
