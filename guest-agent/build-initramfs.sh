#!/usr/bin/env bash
# Builds the guest agent as a static binary and packs it as /init of a gzip'd newc
# cpio initramfs (plus empty /dev, /proc, /sys, /mnt), into a cache directory keyed
# by the binary's sha256, and prints the initramfs path. No root needed:
# /dev/console comes from the kernel's built-in initramfs and the agent mounts
# devtmpfs on /dev itself.
#
#   guest-agent/build-initramfs.sh               build (cargo) if needed, print the path
#   guest-agent/build-initramfs.sh --no-build    pack the already built binary
#
# Environment: VMCTL_CACHE_DIR (default: ${XDG_CACHE_HOME:-~/.cache}/vmctl),
#              CARGO (default: cargo), CARGO_TARGET_DIR (default: <workspace>/target).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
workspace="$(cd "$here/.." && pwd)"
target=x86_64-unknown-linux-gnu
target_dir="${CARGO_TARGET_DIR:-$workspace/target}"
binary="$target_dir/$target/guest-agent/guest-agent"
# shellcheck source=../scripts/lib/cache.sh
source "$workspace/scripts/lib/cache.sh"

say() { echo "agent-initramfs: $*" >&2; }
die() { echo "agent-initramfs: error: $*" >&2; exit 1; }

build=1
case "${1:-}" in
    "") ;;
    --no-build) build=0 ;;
    *) die "usage: $0 [--no-build]" ;;
esac

for tool in cpio gzip sha256sum readelf; do
    command -v "$tool" >/dev/null || die "'$tool' is missing: run scripts/setup.sh"
done

cache_root="${VMCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vmctl}"
# Root building into a user's cache (`sudo -E vmctl`) builds as that user: the cache
# entry, and cargo's output in their target directory, stay theirs.
cache_build_as_owner "$cache_root" "${BASH_SOURCE[0]}" "$@"

cargo="${CARGO:-cargo}"
# rustup's ~/.cargo/bin is often not on PATH where vmctl runs (cron, systemd, an IDE,
# `ssh host cmd`); without cargo at all, an agent built before still serves.
if [[ -z "${CARGO:-}" ]] && ! command -v cargo >/dev/null && [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    cargo="$HOME/.cargo/bin/cargo"
fi
if [[ $build == 1 ]] && ! command -v "$cargo" >/dev/null; then
    [[ -x "$binary" ]] || die "'$cargo' is missing: install Rust (https://rustup.rs), or put it on PATH"
    say "warning: '$cargo' is not on PATH: packing the agent built before ($binary), which may be older than this checkout"
    build=0
fi
if [[ $build == 1 ]]; then
    say "[1/3] building the static agent (cargo build --profile guest-agent -p guest-agent --target $target)"
    (cd "$workspace" &&
        RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
        "$cargo" build --profile guest-agent -p guest-agent --target "$target" >&2) ||
        die "building the agent failed (see above); static glibc needs 'apt-get install libc6-dev'"
else
    say "[1/3] using the existing $binary"
fi
[[ -x "$binary" ]] || die "$binary is missing: run $0 without --no-build"
# A dynamically linked agent would not run in the guest (the initramfs has no libc).
! readelf -l "$binary" | grep -q 'Requesting program interpreter' ||
    die "$binary is not statically linked: rebuild with RUSTFLAGS='-C target-feature=+crt-static'"

mkdir -p "$cache_root/agent-initramfs"
work="$(mktemp -d "$cache_root/agent-initramfs/build.XXXXXX")"
trap 'rm -rf "$work" ${out_dir:+"$out_dir.tmp.$$"}' EXIT

# Strip a copy (the cargo profile keeps symbols); the key is the packed binary's hash.
init="$work/init"
if command -v strip >/dev/null; then
    strip -o "$init" "$binary" || die "strip $binary failed"
else
    cp "$binary" "$init"
fi
chmod 0755 "$init"
binary_sha="$(sha256sum "$init" | cut -d' ' -f1)"
key="$(echo "$binary_sha $(cache_key_of_scripts "${BASH_SOURCE[0]}")" | sha256sum | cut -c1-16)"
out_dir="$cache_root/agent-initramfs/$key"
image="$out_dir/initramfs.cpio.gz"
if [[ -f "$image" ]]; then
    cache_mark_used "$out_dir"
    say "up to date: $image"
    echo "$image"
    exit 0
fi

say "[2/3] staging /init ($(du -h "$init" | cut -f1), sha256 ${binary_sha:0:16}...)"
root="$work/root"
mkdir -p "$root"/{dev,proc,sys,mnt}
mv "$init" "$root/init"

say "[3/3] packing (cpio newc, gzip)"
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
    cpio -o -H newc -R 0:0 --reproducible --quiet) | gzip -9n > "$work/initramfs.cpio.gz"

tmp_out="$out_dir.tmp.$$"
mkdir -p "$tmp_out"
mv "$work/initramfs.cpio.gz" "$tmp_out/initramfs.cpio.gz"
echo "$binary_sha" > "$tmp_out/agent.sha256"
cache_publish "$tmp_out" "$out_dir" initramfs.cpio.gz
cache_prune "$cache_root/agent-initramfs" "????????????????" "$out_dir"
say "done: $image ($(du -h "$image" | cut -f1))"
echo "$image"
