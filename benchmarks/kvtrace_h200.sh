#!/usr/bin/env bash
# The kv-trace replay (issue #10) on the H200 machine, in about 4 minutes:
#   PYTHONPATH=<phoenix installed, e.g. /tmp/phx-site:/tmp/site> OUT=<dir> benchmarks/kvtrace_h200.sh [stages...]
#   stages: smoke disk tmpfs   (default: all)
# Expects phoenix importable (PYTHONPATH set by the caller, as benchmarks/h200.sh's setup
# stage leaves it) and uses PHX_VENDOR=nvidia; torch (else CuPy) for the prefill compute.
# Writes under $OUT: kvtrace-{smoke,disk,tmpfs}.json, kvtrace-{disk,tmpfs}.png and logs.
#
# disk:  the slab on the local disk (/root: virtio, ~2.4 GB/s), cold (page cache dropped per point)
# tmpfs: the slab on /dev/shm, a stand-in for a fast NVMe array (RAM-backed: faster than any SSD)
#
# Model geometry: Llama-3-8B-like (32 layers, 8 KV heads, head dim 128, fp16: 128 KiB/token),
# blocks of 256 tokens (32 MiB). Capacities are small on purpose so that the SSD tier matters:
# HBM 6 GiB for KV, DRAM 4 GiB pinned: DRAM-only evicts and recomputes from ~8 sessions on.
# Simulated: the trace (seeded), think times x0.1, token counts x0.25, 5 s of replay per point (records are
# written after every point, so a timeout keeps what finished).
set -uo pipefail
OUT=${OUT:-/tmp/phx-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
# run from $OUT, not the source tree: `python -m` puts the working directory first on sys.path,
# and the source tree's phoenix/ has no built C core there; phoenix comes from PYTHONPATH
cd "$OUT"
STAGES=${*:-smoke disk tmpfs}
export PYTHONUNBUFFERED=1 PHX_VENDOR=${PHX_VENDOR:-nvidia}
# the SSD tier is read as from a drive: phoenix's page-cache mapping cache (zero-copy warm
# reads of cached file ranges) is off, or the tmpfs stand-in would be served as page cache
export PHX_FMAP_MODE=${PHX_FMAP_MODE:-off}
has() { [[ " $STAGES " == *" $1 "* ]]; }
PY=${PYTHON:-python3}
$PY -c 'import phoenix, phoenix.bench.kvtrace; print("phoenix from", phoenix.__file__)' || { echo "phoenix is not importable: set PYTHONPATH"; exit 2; }

CONC=${PHX_KV_CONC:-1,4,8,16}
DUR=${PHX_KV_DURATION:-5}
COMMON=(--layers 32 --kv-heads 8 --head-dim 128 --q-heads 32 --ffn 14336 --dtype fp16 --block-tokens 256
        --hbm "${PHX_KV_HBM:-6G}" --dram "${PHX_KV_DRAM:-4G}" --ssd "${PHX_KV_SSD:-24G}"
        --sessions 64 --seed 0 --token-scale "${PHX_KV_TOKEN_SCALE:-0.25}" --time-scale "${PHX_KV_TIME_SCALE:-0.1}"
        --warm-start 0.4 --concurrency "$CONC" --duration "$DUR" --threshold 5 --prefill-chunk 4096)

if has smoke; then
    # the same code path with the tiny --dry-run sizes: fails in seconds if the nvidia path is broken
    t0=$(date +%s)
    timeout 90 $PY -m phoenix.cli.phx bench kv-trace --dry-run --concurrency 1,4 --duration 1 \
        --slab /root/phx-kv-smoke.slab --json "$OUT/kvtrace-smoke.json" > "$OUT/kvtrace-smoke.log" 2>&1
    rc=$?; echo "smoke rc=$rc ($(( $(date +%s) - t0 )) s)"; tail -12 "$OUT/kvtrace-smoke.log"
    if [ $rc -ne 0 ]; then echo "smoke failed: not running the full replay"; exit $rc; fi
fi

if has disk; then
    t0=$(date +%s)
    timeout ${PHX_KV_DISK_TIMEOUT:-150} $PY -m phoenix.cli.phx bench kv-trace "${COMMON[@]}" --slab /root/phx-kvtrace.slab \
        --label "local disk (/root, ~2.4 GB/s)" --json "$OUT/kvtrace-disk.json" --plot "$OUT/kvtrace-disk.png" \
        > "$OUT/kvtrace-disk.log" 2>&1
    echo "disk rc=$? ($(( $(date +%s) - t0 )) s)"; tail -20 "$OUT/kvtrace-disk.log"
    rm -f /root/phx-kvtrace.slab /root/phx-kvtrace.slab.history
fi

if has tmpfs; then
    t0=$(date +%s)
    timeout ${PHX_KV_TMPFS_TIMEOUT:-100} $PY -m phoenix.cli.phx bench kv-trace "${COMMON[@]}" --slab /dev/shm/phx-kvtrace.slab \
        --label "tmpfs (/dev/shm): stand-in for a fast NVMe array" --json "$OUT/kvtrace-tmpfs.json" \
        --plot "$OUT/kvtrace-tmpfs.png" > "$OUT/kvtrace-tmpfs.log" 2>&1
    echo "tmpfs rc=$? ($(( $(date +%s) - t0 )) s)"; tail -20 "$OUT/kvtrace-tmpfs.log"
    rm -f /dev/shm/phx-kvtrace.slab /dev/shm/phx-kvtrace.slab.history
fi
