#!/usr/bin/env bash
# Builds a kernel (`vmlinux`, no modules) from Debian's linux-source package into a
# cache directory keyed by the config fragments, the source, gcc and binutils versions
# and the build scripts' own text, and reuses it when nothing changed (entries of other
# keys unused for 30 days go at the next build). So a Debian update of linux-source-6.1
# (a security fix; unattended-upgrades installs them) makes the next use rebuild the
# kernel from the new source (~6-10 min on 2 cores, saying why, with its progress):
# run scripts/setup.sh after such an update to have that done before a VM needs it.
# Two flavours:
#   guest        guest.config: what every VM boots
#   nested-host  guest.config + nested-host.config: the QEMU-TCG guest that runs the
#                VMM where this machine's /dev/kvm cannot boot Linux (see README)
#
#   kernel-config/build.sh [guest|nested-host]               build if needed, print the path
#   kernel-config/build.sh [guest|nested-host] --print-path  print where it would be
#
# Environment: VMCTL_CACHE_DIR (default: ${XDG_CACHE_HOME:-~/.cache}/vmctl),
#              VMCTL_KERNEL_JOBS (default: nproc + 1).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source_package=linux-source-6.1
source_tarball=/usr/src/linux-source-6.1.tar.xz
flavour=guest
if [[ "${1:-}" == guest || "${1:-}" == nested-host ]]; then flavour="$1"; shift; fi
case "$flavour" in
    guest) fragments=("$here/guest.config") ;;
    nested-host) fragments=("$here/guest.config" "$here/nested-host.config") ;;
esac
# shellcheck source=../scripts/lib/cache.sh
source "$here/../scripts/lib/cache.sh"

say() { echo "kernel: $*" >&2; }
die() { echo "kernel: error: $*" >&2; exit 1; }

source_version="$(dpkg-query -W -f='${Version}' "$source_package" 2>/dev/null || true)"
[[ -n "$source_version" && -r "$source_tarball" ]] ||
    die "$source_tarball is missing: run 'apt-get install $source_package' (or scripts/setup.sh)"

# The toolchain's versions too: a vmlinux is only as good as the gcc and ld that built it.
# Debian's package revisions where dpkg knows them: a security fix to gcc or binutils
# (12.2.0-14 to 12.2.0-14+deb12u1) leaves the upstream version as it was.
package_revision() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }
gcc_version="$(gcc -dumpfullversion 2>/dev/null || echo none)"
ld_version="$(ld --version 2>/dev/null | head -n1 | awk '{print $NF}' || true)"
gcc_revision="$(package_revision "gcc-${gcc_version%%.*}")"
ld_revision="$(package_revision binutils)"
compiler="gcc-${gcc_revision:-$gcc_version} ld-${ld_revision:-$ld_version}"
# What this checkout asks for (fragments, scripts), apart from the host's versions: a
# rebuild can then say whether only those changed.
inputs="$( { cache_key_of_scripts "${BASH_SOURCE[0]}"; cat "${fragments[@]}"; } | sha256sum | cut -c1-16)"
key="$(echo "$source_version $compiler $inputs" | sha256sum | cut -c1-16)"
cache_root="${VMCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vmctl}"
out_dir="$cache_root/kernel/$flavour-$key"
vmlinux="$out_dir/vmlinux"

case "${1:-}" in
    "") ;;
    --print-path) echo "$vmlinux"; exit 0 ;;
    *) die "usage: $0 [guest|nested-host] [--print-path]" ;;
esac
if [[ -f "$vmlinux" ]]; then cache_mark_used "$out_dir"; echo "$vmlinux"; exit 0; fi
# Root building into a user's cache (`sudo -E vmctl`) builds as that user.
cache_build_as_owner "$cache_root" kernel "${BASH_SOURCE[0]}" "$flavour"

# One build at a time per flavour: a second caller waits, then finds the result.
mkdir -p "$cache_root/kernel"
exec 9>"$cache_root/kernel/.$flavour.lock"
if ! flock -n 9; then
    say "another build of the $flavour kernel is running; waiting for it"
    flock 9
fi
if [[ -f "$vmlinux" ]]; then echo "$vmlinux"; exit 0; fi

# Why there is no kernel for this key, from the most recently used one of this flavour
# (nothing when there is none): a kernel rebuilt minutes into someone's command should
# say what made it necessary.
why_rebuild() {
    local previous="" entry old
    for entry in "$cache_root/kernel/$flavour-"????????????????; do
        if [[ -f "$entry/vmlinux" && ( -z "$previous" || "$entry" -nt "$previous" ) ]]; then
            previous="$entry"
        fi
    done
    [[ -n "$previous" ]] || return 0
    old="$(cat "$previous/source-version" 2>/dev/null || echo unknown)"
    [[ "$old" == "$source_version" ]] ||
        echo "$source_package went from $old to $source_version (a Debian update)"
    old="$(cat "$previous/compiler" 2>/dev/null || echo unknown)"
    [[ "$old" == "$compiler" || "$old" == unknown ]] || echo "the toolchain went from $old to $compiler"
    old="$(cat "$previous/inputs" 2>/dev/null || echo unknown)"
    [[ "$old" == "$inputs" ]] || echo "this checkout's config fragments or build scripts differ from ${previous##*/}'s"
}
reasons="$(why_rebuild | paste -sd ';' | sed 's/;/; /g')"
[[ -z "$reasons" ]] || say "rebuilding the $flavour kernel: $reasons"

# Kbuild splits its paths on spaces: say so now, not in a make error minutes later.
[[ "$cache_root" != *[[:space:]]* ]] ||
    die "the kernel cannot be built under '$cache_root' (a path with a space); set VMCTL_CACHE_DIR to a directory whose path has none"
for tool in make gcc bc flex bison xz; do
    command -v "$tool" >/dev/null || die "'$tool' is missing: run scripts/setup.sh"
done

# One work directory per flavour, so a build killed outright (its trap never ran)
# leaves at most one, which the next build under the lock clears.
work="$cache_root/kernel/build.$flavour"
rm -rf "$work" "$out_dir.tmp"
mkdir -p "$work"
trap 'rm -rf "$work" "$out_dir.tmp"' EXIT

say "building the $flavour kernel (Linux $source_version) into $out_dir (takes ~6 min on 2 cores; cached afterwards)"
say "[1/4] unpacking $source_tarball"
tar -xf "$source_tarball" -C "$work"
src="$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n1)"

say "[2/4] configuring: allnoconfig + ${fragments[*]##*/}"
make -C "$src" -s allnoconfig >/dev/null
# merge_config.sh splits its list of fragments on spaces and keeps its temporary files
# in the directory it runs from: give it copies under the work directory, from there.
merged=()
for fragment in "${fragments[@]}"; do
    cp "$fragment" "$work/${fragment##*/}"
    merged+=("$work/${fragment##*/}")
done
(cd "$work" && "$src/scripts/kconfig/merge_config.sh" -m -O "$src" "$src/.config" "${merged[@]}" >/dev/null)
make -C "$src" -s olddefconfig >/dev/null

# merge_config.sh only warns when Kconfig drops an option; a silently missing
# option would surface much later as a guest that cannot mount or boot. As in the
# merge, a later fragment's setting of an option overrides an earlier one's.
declare -A wanted=()
options=()
while IFS= read -r line; do
    case "$line" in
        CONFIG_*=*) opt="${line%%=*}" ;;
        "# CONFIG_"*" is not set") opt="${line#\# }"; opt="${opt%% *}" ;;
        *) continue ;;
    esac
    [[ -v "wanted[$opt]" ]] || options+=("$opt")
    wanted[$opt]="$line"
done < <(cat "${fragments[@]}")
missing=0
for opt in "${options[@]}"; do
    line="${wanted[$opt]}"
    case "$line" in
        CONFIG_*=*) grep -qxF "$line" "$src/.config" || { say "option not applied: $line"; missing=1; } ;;
        *) if grep -q "^$opt=" "$src/.config"; then say "option not disabled: $opt"; missing=1; fi ;;
    esac
done
[[ $missing == 0 ]] || die "the kernel rejected options of the fragment (dependencies missing?)"

jobs="${VMCTL_KERNEL_JOBS:-$(( $(nproc) + 1 ))}"
# The log outlives a failed build (the work directory goes with it) until the next
# build of this flavour succeeds, or a day passes (cache_prune).
failed_log="$cache_root/kernel/$flavour-$key.failed.log"
say "[3/4] compiling vmlinux with $jobs jobs (log: $work/build.log)"
if ! make -C "$src" -j"$jobs" vmlinux 2>&1 | tee "$work/build.log" |
        awk '/^  (CC|AS|LD|AR)/ { n++; if (n % 250 == 0) { printf "kernel:       %d objects built\n", n > "/dev/stderr" } }'; then
    tail -n 40 "$work/build.log" >&2
    cp "$work/build.log" "$failed_log" 2>/dev/null || true
    die "kernel build failed (output above; full log: $failed_log)"
fi

say "[4/4] storing in $out_dir"
mkdir -p "$out_dir.tmp"
cp "$src/vmlinux" "$out_dir.tmp/vmlinux"
cp "$src/.config" "$out_dir.tmp/config"
echo "$source_version" > "$out_dir.tmp/source-version"
echo "$compiler" > "$out_dir.tmp/compiler"
echo "$inputs" > "$out_dir.tmp/inputs"
rm -rf "$out_dir" "$cache_root/kernel/$flavour-"*.failed.log
cache_publish "$out_dir.tmp" "$out_dir" vmlinux
cache_prune "$cache_root/kernel" "$flavour-????????????????" "$out_dir"
say "done: $vmlinux ($(du -h "$vmlinux" | cut -f1))"
echo "$vmlinux"
