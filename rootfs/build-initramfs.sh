#!/usr/bin/env bash
# Builds the minimal test/hello guest initramfs (gzip'd newc cpio) from Debian's
# busybox-static, rootfs/init and rootfs/boot-timer.c, into a cache directory keyed by
# those inputs and the gcc and static libc (libc6-dev) that build boot-timer, and
# reuses it when nothing changed. No root needed: /dev/console comes from the kernel's
# built-in initramfs and /init mounts devtmpfs on /dev.
#
#   rootfs/build-initramfs.sh               build if needed, print the initramfs path
#   rootfs/build-initramfs.sh --print-path  print where it would be, build nothing
#
# Tests append a second (uncompressed, 4-byte aligned) cpio archive holding
# /etc/vmtest.sh; /init runs it instead of printing the hello line.
#
# Environment: VMCTL_CACHE_DIR (default: ${XDG_CACHE_HOME:-~/.cache}/vmctl),
#              VMCTL_BUSYBOX (default: /bin/busybox, from busybox-static).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
busybox="${VMCTL_BUSYBOX:-/bin/busybox}"
inputs=("$here/build-initramfs.sh" "$here/init" "$here/boot-timer.c")

# shellcheck source=../scripts/lib/cache.sh
source "$here/../scripts/lib/cache.sh"

say() { echo "initramfs: $*" >&2; }
die() { echo "initramfs: error: $*" >&2; exit 1; }

[[ -x "$busybox" ]] || die "$busybox is missing: run 'apt-get install busybox-static' (or scripts/setup.sh)"
# A dynamically linked busybox (Debian's 'busybox' package) would not run in the guest.
if ldd "$busybox" >/dev/null 2>&1; then
    die "$busybox is dynamically linked: run 'apt-get install busybox-static'"
fi
busybox_version="$("$busybox" 2>&1 | head -n1 || true)"
# boot-timer links libc.a in: a glibc update (a security fix) is one to its binary too.
toolchain="gcc-$(gcc -dumpfullversion 2>/dev/null || echo none) libc6-dev-$(dpkg-query -W -f='${Version}' libc6-dev 2>/dev/null || echo none)"

key="$( { echo "$busybox_version $toolchain $(cache_key_of_scripts "${BASH_SOURCE[0]}")"; sha256sum "$busybox" | cut -d' ' -f1
          cat "${inputs[@]}"; } |
        sha256sum | cut -c1-16)"
cache_root="${VMCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vmctl}"
out_dir="$cache_root/initramfs/$key"
image="$out_dir/initramfs.cpio.gz"

if [[ "${1:-}" == "--print-path" ]]; then echo "$image"; exit 0; fi
if [[ -f "$image" ]]; then cache_mark_used "$out_dir"; echo "$image"; exit 0; fi
# Root building into a user's cache (`sudo -E vmctl`) builds as that user.
cache_build_as_owner "$cache_root" initramfs "${BASH_SOURCE[0]}"

for tool in gcc cpio gzip; do
    command -v "$tool" >/dev/null || die "'$tool' is missing: run scripts/setup.sh"
done

mkdir -p "$cache_root/initramfs"
work="$(mktemp -d "$cache_root/initramfs/build.XXXXXX")"
trap 'rm -rf "$work" "$out_dir.tmp.$$"' EXIT
root="$work/root"

say "building into $out_dir"
say "[1/3] compiling boot-timer (static)"
gcc -static -Os -s -Wall -Werror -o "$work/boot-timer" "$here/boot-timer.c" 2>"$work/gcc.log" || {
    cat "$work/gcc.log" >&2
    [[ -e /usr/lib/x86_64-linux-gnu/libc.a ]] ||
        die "static libc is missing: run 'apt-get install libc6-dev'"
    die "compiling boot-timer.c failed (see the lines above)"
}

say "[2/3] staging busybox (${busybox_version%% (*}) and /init"
mkdir -p "$root"/{bin,dev,etc,proc,sys,tmp,run,root,mnt,usr}
ln -s bin "$root/sbin"
ln -s ../bin "$root/usr/bin"
ln -s ../bin "$root/usr/sbin"
install -m 0755 "$busybox" "$root/bin/busybox"
install -m 0755 "$work/boot-timer" "$root/bin/boot-timer"
install -m 0755 "$here/init" "$root/init"
# One relative symlink per applet, all in /bin (sh, mount, cat, dd, grep, nproc, ...).
applets=0
while IFS= read -r applet; do
    [[ -n "$applet" && "$applet" != busybox && ! -e "$root/bin/$applet" ]] || continue
    ln -s busybox "$root/bin/$applet"
    applets=$((applets + 1))
done < <("$busybox" --list)
for needed in sh mount cat dd echo grep nproc uname reboot sync sleep od head cmp printf; do
    [[ -e "$root/bin/$needed" ]] || die "$busybox lacks the '$needed' applet"
done
echo "root:x:0:0:root:/root:/bin/sh" > "$root/etc/passwd"
echo "root:x:0:" > "$root/etc/group"
chmod 1777 "$root/tmp"

say "[3/3] packing $applets applets + init + boot-timer (cpio newc, gzip)"
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
    cpio -o -H newc -R 0:0 --reproducible --quiet) | gzip -9n > "$work/initramfs.cpio.gz"

mkdir -p "$out_dir.tmp.$$"
mv "$work/initramfs.cpio.gz" "$out_dir.tmp.$$/initramfs.cpio.gz"
echo "$busybox_version" > "$out_dir.tmp.$$/busybox-version"
cache_publish "$out_dir.tmp.$$" "$out_dir" initramfs.cpio.gz
cache_prune "$cache_root/initramfs" "????????????????" "$out_dir"
say "done: $image ($(du -h "$image" | cut -f1))"
echo "$image"
