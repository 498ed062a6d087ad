#!/usr/bin/env bash
# The kernel side's CI, on a Debian 12 machine as root (apt) or with the packages present:
#
#   1. installs what is missing: Debian's kernel headers, QEMU, a static busybox, gcc,
#      make, sparse, libc6-dev (for the static test program); fetches the kernel image
#      that matches the headers and unpacks it (no install: no initramfs to generate);
#   2. builds phx_core.ko and every vendors/<name>/p2p.c backend with -Werror, with
#      sparse (make check), and the static test program;
#   3. boots that kernel in QEMU (software emulation, bounded) with the modules and runs
#      the direct-path test: O_DIRECT to and from ZONE_DEVICE pages over a fake
#      accelerator's PCI BAR, every byte verified from the other side, kill -9, bad
#      ioctl arguments, revocation, races, clean unload, guest log checked.
#
#   kernel/ci.sh                 install if needed, build, test
#   kernel/ci.sh --no-install    never call apt (fail if something is missing)
#   kernel/ci.sh --install-only  only install (e.g. in an image build step)
#
# Environment: PHX_KTEST_ACCEL=tcg|kvm|auto (default tcg), PHX_KTEST_TIMEOUT (default 300 s),
# PHX_KIMAGE_DIR (where the kernel image is unpacked; default /var/cache/phx-kimage).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
install=1
test=1
for arg in "$@"; do
    case $arg in
        --no-install) install=0 ;;
        --install-only) test=0 ;;
        *) echo "usage: $0 [--no-install|--install-only]" >&2; exit 2 ;;
    esac
done
t0=$(date +%s)
say() { echo "[kernel-ci] $*"; }

headers_dir() { ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1; }
krel_of() { basename "$1" | sed 's/^linux-headers-//'; }

pkgs=(linux-headers-amd64 qemu-system-x86 busybox-static gcc make libc6-dev sparse e2fsprogs python3 ca-certificates)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    if ((!install)); then
        echo "[kernel-ci] missing packages: ${missing[*]} (run without --no-install, as root)" >&2
        exit 2
    fi
    say "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

hdr=$(headers_dir)
[ -n "$hdr" ] || { echo "[kernel-ci] no /usr/src/linux-headers-*-amd64" >&2; exit 2; }
krel=$(krel_of "$hdr")
kimage=${PHX_KIMAGE_DIR:-/var/cache/phx-kimage}/$krel
if [ ! -e "$kimage/boot/vmlinuz-$krel" ]; then
    if [ -e "/boot/vmlinuz-$krel" ] && [ -d "/lib/modules/$krel/kernel" ]; then
        kimage=/                                    # installed already
    elif ((install)); then
        say "fetching linux-image-$krel (unpacked into $kimage, not installed)"
        tmp=$(mktemp -d)
        chown _apt "$tmp" 2>/dev/null || true       # apt downloads as _apt when it can
        (cd "$tmp" && apt-get download -qq "linux-image-$krel" >/dev/null)
        mkdir -p "$kimage"
        dpkg-deb -x "$tmp"/linux-image-"$krel"_*.deb "$kimage"
        rm -rf "$tmp"
    else
        echo "[kernel-ci] no kernel image $krel (in /boot or $kimage)" >&2
        exit 2
    fi
fi
say "prepared in $(( $(date +%s) - t0 )) s: headers $hdr, image $kimage (kernel $krel)"
((test)) || exit 0

t1=$(date +%s)
make -s -C "$here" clean
# sparse (C=2) compiles with -Werror and checks every file; its findings fail the build too
out=$(make -C "$here" KDIR="$hdr" check 2>&1) || { echo "$out"; exit 1; }
if echo "$out" | grep -E "(warning|error):" ; then
    echo "[kernel-ci] sparse or the compiler reported the lines above" >&2
    exit 1
fi
make -s -C "$here" KDIR="$hdr" ktest
say "built with -Werror and sparse in $(( $(date +%s) - t1 )) s: $(cd "$here/build" && echo *.ko)"

python3 "$here/qemu/run.py" --build "$here/build" --root "$kimage" --krel "$krel" \
    --timeout "${PHX_KTEST_TIMEOUT:-300}"
say "done in $(( $(date +%s) - t0 )) s"
