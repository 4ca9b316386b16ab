#!/usr/bin/env bash
# Builds the guest agent as a static binary and packs it as /init of a newc cpio
# initramfs (plus empty /dev, /proc, /sys, /mnt), into a cache directory keyed by the
# binary's sha256, and prints the initramfs path. Not compressed: the guest kernel
# would spend some 10-20 ms of every boot inflating it, to save 2 MB of a host file
# and of guest memory it frees once unpacked. No root needed:
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

for tool in cpio sha256sum readelf; do
    command -v "$tool" >/dev/null || die "'$tool' is missing: run scripts/setup.sh"
done

cache_root="${VMCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vmctl}"

# unwritable_for UID:GID HOME: prints the first path this build writes that the user
# could not (asked as them: modes, groups and ACLs all count), or "?" if they could not
# be asked; nothing if they could write it all. Those are: cargo's target directory
# (else the directory it would be made in), the agent's build directories in it, with
# all they hold (cargo's locks and fingerprints), cargo's package lock in their cargo
# home, and the cache's agent directory with its entries (cache_unwritable_for: a
# killed or old one is removed). Only the agent's own part of the target directory is
# walked: it may hold a whole workspace's builds.
unwritable_for() {
    local owner="$1" home="$2" dir shallow=() deep=() found
    dir="$target_dir"
    while [[ ! -e "$dir" ]]; do dir="$(dirname "$dir")"; done
    shallow+=("$dir")
    for dir in "$target_dir/$target" "${CARGO_HOME:-$home/.cargo}/.package-cache"; do
        [[ ! -e "$dir" ]] || shallow+=("$dir")
    done
    for dir in "$target_dir/$target/guest-agent" "$target_dir/guest-agent"; do
        [[ ! -e "$dir" ]] || deep+=("$dir")
    done
    # find fails where it cannot read a directory: that too would fail their build.
    found="$(setpriv --reuid="${owner%:*}" --regid="${owner#*:}" --init-groups -- \
        find "${shallow[@]}" -maxdepth 0 ! -writable -print -quit 2>/dev/null)" || found="${found:-?}"
    if [[ -z "$found" && ${#deep[@]} -gt 0 ]]; then
        found="$(setpriv --reuid="${owner%:*}" --regid="${owner#*:}" --init-groups -- \
            find "${deep[@]}" ! -type l ! -writable -print -quit 2>/dev/null)" || found="${found:-?}"
    fi
    [[ -n "$found" ]] || found="$(cache_unwritable_for "$owner" "$cache_root" agent-initramfs)"
    echo "$found"
}

# Root building into a user's cache (`sudo -E vmctl`) builds as that user: the cache
# entry, and cargo's output in their target directory, stay theirs. Unless they could
# not: a SUDO_UID with no account has no home or groups to build with, and a target
# directory root made (`sudo -E ./scripts/setup.sh` builds vmctl first, as root; a
# checkout that is root's) fails their cargo where root's works. Root then builds, as
# it did before, and says why.
owner="$(cache_owner "$cache_root")"
if [[ -n "$owner" ]]; then
    if ! owner_home="$(getent passwd "${owner%:*}" | cut -d: -f6)" || [[ -z "$owner_home" ]]; then
        say "the cache $cache_root is uid ${owner%:*}'s (SUDO_UID), which names no account: building as root"
    elif unwritable="$(unwritable_for "$owner" "$owner_home")" && [[ -n "$unwritable" ]]; then
        [[ "$unwritable" != "?" ]] || unwritable="what it would write (asking as them failed)"
        say "the cache $cache_root is uid ${owner%:*}'s, but they could not write $unwritable: building as root (what it adds to their cache is then root's; 'chown -R ${owner%:*}' what is root's there to have the agent built as them)"
    else
        cache_build_as_owner "$cache_root" agent-initramfs "${BASH_SOURCE[0]}" "$@"
    fi
fi

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
image="$out_dir/initramfs.cpio"
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

say "[3/3] packing (cpio newc)"
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
    cpio -o -H newc -R 0:0 --reproducible --quiet) > "$work/initramfs.cpio"

tmp_out="$out_dir.tmp.$$"
mkdir -p "$tmp_out"
mv "$work/initramfs.cpio" "$tmp_out/initramfs.cpio"
echo "$binary_sha" > "$tmp_out/agent.sha256"
cache_publish "$tmp_out" "$out_dir" initramfs.cpio
cache_prune "$cache_root/agent-initramfs" "????????????????" "$out_dir"
say "done: $image ($(du -h "$image" | cut -f1))"
echo "$image"
