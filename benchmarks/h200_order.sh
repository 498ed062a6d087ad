#!/usr/bin/env bash
# The caller-stream issue on the H200, in one call: this tree against the tree before the
# change (carried in .old/: `git archive <commit> | tar -x -C .old`), in the same run.
#   benchmarks/h200_order.sh [stages...]   stages: setup conformance race bench (default: all)
# conformance: `phx-port test nvidia` of this tree (io_caller_stream with torch and CuPy);
# race: benchmarks/caller_stream_race.py with each tree (wrong runs of 5, 1 GiB);
# bench: `phx bench` cold read + 64 KiB random reads on the disk and warm reads from tmpfs,
# old and new alternating (old new old new), each beside its own raw reference.
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/phx-out}; mkdir -p "$FINAL"
# ($OUT brings back 8 files at most: everything goes here, then one archive and the report)
OUT=/tmp/phx-order; rm -rf "$OUT"; mkdir -p "$OUT"
finish() { cp "$OUT"/conformance-nvidia.* "$OUT"/conformance.log "$FINAL"/ 2>/dev/null
           tar czf "$FINAL/h200-order.tgz" -C "$OUT" . ; }
trap finish EXIT
STAGES=${*:-setup conformance race bench}
export PYTHONUNBUFFERED=1 PHX_VENDOR=nvidia
NEW=/tmp/phx-site OLD=/tmp/phx-old
has() { [[ " $STAGES " == *" $1 "* ]]; }
with() { local site=$1; shift; PYTHONPATH=$site PATH=$site/bin:$PATH "$@"; }

if has setup; then
    t0=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$NEW" . 2>&1 | tail -3
    (cd .old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$OLD" . 2>&1 | tail -3)
    echo "setup: $(( $(date +%s) - t0 )) s"
fi

if has conformance; then
    with $NEW timeout ${PHX_CONF_TIMEOUT:-240} phx-port test nvidia --report-dir "$OUT" > "$OUT/conformance.log" 2>&1
    echo "conformance rc=$?"; tail -27 "$OUT/conformance.log"
fi

if has race; then
    for tree in old new; do
        site=$NEW; [ $tree = old ] && site=$OLD
        echo "race, $tree tree:"
        with $site timeout 120 python3 -P benchmarks/caller_stream_race.py --file /dev/shm/phx-race.bin \
            --json "$OUT/race-$tree.json" 2>&1 | tail -8
    done
fi

if has bench; then
    SIZE=${PHX_BENCH_SIZE:-4G}
    for i in 1 2; do
        for tree in old new; do
            site=$NEW; [ $tree = old ] && site=$OLD
            with $site timeout 150 phx bench --file /root/phx-bench.bin --size "$SIZE" --threads 16 --chunk 16M \
                --ops read,randread --random-ops ${PHX_RANDOM_OPS:-40000} --temperature cold --reps 1 --quiet \
                --json "$OUT/bench-cold-$tree-$i.json" > "$OUT/bench-cold-$tree-$i.txt" 2>&1; echo "cold $tree $i rc=$?"
            with $site timeout 100 phx bench --file /dev/shm/phx-bench.bin --size "$SIZE" --threads 16 --chunk 16M \
                --ops read --temperature warm --reps 2 --quiet --json "$OUT/bench-warm-$tree-$i.json" \
                > "$OUT/bench-warm-$tree-$i.txt" 2>&1
            echo "warm $tree $i rc=$?"
        done
    done
    rm -f /dev/shm/phx-bench.bin
    for f in "$OUT"/bench-*.txt; do echo "== $(basename $f)"; grep -E "^(read|randread) " "$f"; done
fi
