#!/usr/bin/env bash
# The project's test command: unit tests and VM tests (`cargo test --workspace`), with
# the guest kernel and initramfs built first (cached) and handed to the tests.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p vm-tests -- --nocapture`).
#
# VM tests skip (loudly) where vmctl cannot boot a guest; the skips are listed at the
# end. Exit status: non-zero if cargo test fails, or if VMCTL_REQUIRE_VM=1 and any VM
# test was skipped.
#
# Environment: VMCTL_REQUIRE_VM=1 (fail instead of skipping), VMCTL_CACHE_DIR,
#              CARGO_TARGET_DIR, VMCTL_QEMU, VMCTL_VIRTIOFSD (as for vmctl: checked
#              before the tests run, as setup.sh checks it); exported to the tests:
#              VMCTL_KERNEL, VMCTL_NESTED_KERNEL, VMCTL_INITRAMFS,
#              VMCTL_AGENT_INITRAMFS, VMCTL_ROOTFS, VMCTL_BIN, VMCTL_SKIP_FILE,
#              VMCTL_RETRY_FILE, VMCTL_PARTIAL_FILE, VMCTL_WAKEUP_FILE.
#
# Run as a normal user, it builds what needs root (the root filesystems) through sudo,
# into this user's cache.
#
# In the nested host (no hardware KVM), a VM scenario whose VM the nested host lost
# (README, "Known problem") is retried, at most three times; the retries are listed at
# the end too. On hardware KVM nothing is retried. The lost interrupts and
# notifications the VM tests' VMMs made up for (README, "Known problem") are listed
# at the end as well; they fail nothing.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=lib/rootfs-as-root.sh
source "$root/scripts/lib/rootfs-as-root.sh"
# shellcheck source=lib/virtiofsd.sh
source "$root/scripts/lib/virtiofsd.sh"

say() { echo "test: $*" >&2; }
die() { echo "test: error: $*" >&2; exit 1; }

if ! command -v cargo >/dev/null && [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null || die "cargo is missing: install the Rust toolchain, then run scripts/setup.sh"

# vmctl's own rule, settled once: the build scripts below, run as root with SUDO_UID set
# (`sudo -s`), would otherwise put the root filesystem in the invoking user's cache.
export VMCTL_CACHE_DIR="${VMCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vmctl}"

target_dir="${CARGO_TARGET_DIR:-target}"
[[ "$target_dir" == /* ]] || target_dir="$root/$target_dir"

# A build script that fails says why (and, where a tool or package is missing, to run
# scripts/setup.sh, which installs it): setup would build the same way.
say "guest kernel (kernel-config/build.sh guest)"
VMCTL_KERNEL="$(kernel-config/build.sh guest)" || die "building the guest kernel failed (messages above)"
if command -v "${VMCTL_QEMU:-qemu-system-x86_64}" >/dev/null ||
        [[ ! -e /sys/module/kvm_intel && ! -e /sys/module/kvm_amd ]]; then
    # The nested-exec tests run wherever QEMU is, hardware KVM or not, and without it
    # every VM test goes through the nested host: its kernel's first build (6-10 min)
    # must not run under a test's VM timeout, which would kill it, and the next test's
    # build, again and again.
    say "nested host kernel (kernel-config/build.sh nested-host)"
    VMCTL_NESTED_KERNEL="$(kernel-config/build.sh nested-host)" ||
        die "building the nested host kernel failed (messages above)"
    export VMCTL_NESTED_KERNEL
fi
say "initramfs (rootfs/build-initramfs.sh)"
VMCTL_INITRAMFS="$(rootfs/build-initramfs.sh)" || die "building the initramfs failed (messages above)"
say "guest agent (guest-agent/build-initramfs.sh)"
VMCTL_AGENT_INITRAMFS="$(guest-agent/build-initramfs.sh)" || die "building the guest agent failed (messages above)"
# Prints the root filesystem image of RECIPE (none: the default one), building it
# first, as root: through sudo for a normal user, as setup.sh does.
# (A cached one through the script too, which marks it as used.)
rootfs_image() { # [RECIPE]
    local build=("$root/rootfs/build-rootfs.sh")
    if [[ ! -f "$(rootfs/build-rootfs.sh "$@" --print-path)" ]]; then
        rootfs_build_command build "$root/rootfs/build-rootfs.sh" ||
            die "building the root filesystem ${1:-} needs root, and there is no sudo: run" \
                "'VMCTL_CACHE_DIR=$VMCTL_CACHE_DIR rootfs/build-rootfs.sh${1:+ $1}' as root first"
        [[ $(id -u) == 0 ]] || say "  (as root, through sudo)"
    fi
    "${build[@]}" "$@"
}
say "guest root filesystem (rootfs/build-rootfs.sh)"
VMCTL_ROOTFS="$(rootfs_image)" || die "building the guest root filesystem failed (messages above)"
# The recipe test's image too: its first build (minutes, more with other tests' VMs on
# the same CPUs) must not run under that test's VM timeout.
extra_recipe=rootfs/recipes/example-extra.recipe
say "the recipe test's root filesystem (rootfs/build-rootfs.sh $extra_recipe)"
rootfs_image "$extra_recipe" >/dev/null || die "building $extra_recipe failed (messages above)"
export VMCTL_AGENT_INITRAMFS VMCTL_ROOTFS
# The virtiofsd the tests' vmctl will run (workspace VMs share their workspace through
# it), found as vmctl finds it, with this PATH, which the tests get.
virtiofsd="$(vmctl_virtiofsd "$PATH")"
if [[ -z "$virtiofsd" ]]; then
    die "vmctl would find no virtiofsd $virtiofsd_min_version or later (it looks on PATH, then" \
        "in ~/.cargo/bin, /usr/libexec, /usr/lib/qemu): run scripts/setup.sh, or set VMCTL_VIRTIOFSD"
elif ! virtiofsd_is_recent "$virtiofsd"; then
    die "VMCTL_VIRTIOFSD names $virtiofsd, which vmctl refuses (it runs the Rust virtiofsd" \
        "$virtiofsd_min_version or later): unset it, or name one that is"
fi
say "vmctl (cargo build --release -p vmctl)"
cargo build --release --quiet -p vmctl || die "building vmctl failed"
VMCTL_BIN="$target_dir/release/vmctl"
[[ -x "$VMCTL_BIN" ]] || die "$VMCTL_BIN missing after building it"

VMCTL_SKIP_FILE="$target_dir/vm-tests-skipped.txt"
VMCTL_RETRY_FILE="$target_dir/vm-tests-retried.txt"
VMCTL_PARTIAL_FILE="$target_dir/vm-tests-partial.txt"
VMCTL_WAKEUP_FILE="$target_dir/vm-tests-wakeups.txt"
mkdir -p "$target_dir"
: > "$VMCTL_SKIP_FILE"
: > "$VMCTL_RETRY_FILE"
: > "$VMCTL_PARTIAL_FILE"
: > "$VMCTL_WAKEUP_FILE"
export VMCTL_KERNEL VMCTL_INITRAMFS VMCTL_BIN VMCTL_SKIP_FILE VMCTL_RETRY_FILE VMCTL_PARTIAL_FILE \
    VMCTL_WAKEUP_FILE

# --workspace unless the caller picked packages (cargo would ignore their -p).
scope=(--workspace)
for arg in "$@"; do
    case "$arg" in --) break ;; -p|-p*|--package|--package=*) scope=() ;; esac
done
# --no-fail-fast: a VM test binary that fails must not keep the others from running;
# one run then shows every failure (CI's is half an hour).
say "cargo test --no-fail-fast ${scope[*]}${scope[*]:+ }$*"
status=0
cargo test --no-fail-fast "${scope[@]}" "$@" || status=$?

# Prints how many lines FILE has and, when there are any, a box listing them with
# their PREFIX dropped; sets `counted`.
report_list() { # file title prefix
    counted=0
    [[ -s "$1" ]] && counted="$(wc -l < "$1")"
    if (( counted > 0 )); then
        {
            echo
            echo "######################################################################"
            echo "#  $2: $counted"
            sed "s/^$3 /#    /" "$1"
            echo "######################################################################"
        } >&2
    else
        say "$2: 0"
    fi
}
report_list "$VMCTL_RETRY_FILE" \
    "VM test attempts that lost their VM in the nested host and were retried" "RETRIED VM TEST"
# A retry whose hang report saw the command end once the diagnosis's own traffic went
# through may hide a lost wake-up of ours rather than the nested host's stall.
if [[ -s "$VMCTL_RETRY_FILE" ]] && suspects="$(grep -c 'LOST WAKE-UP?' "$VMCTL_RETRY_FILE")"; then
    say "WARNING: $suspects of those retries may hide a lost wake-up (marked LOST WAKE-UP?): read their hang reports above"
fi
# What the VMMs made up for: the tests passed through it, and it shows how often the
# nested host (or a bug of ours) loses a wake-up.
report_list "$VMCTL_WAKEUP_FILE" \
    "Lost wake-ups the VM tests' VMMs made up for" "LOST WAKE-UP MADE UP FOR"
# Checks a test that ran left out on this machine (running as a normal user, say).
report_list "$VMCTL_PARTIAL_FILE" "Checks of VM tests that ran, not made here" "CHECK NOT MADE"
report_list "$VMCTL_SKIP_FILE" "VM tests skipped" "SKIPPED VM TEST"
skipped=$counted

if (( status != 0 )); then
    die "cargo test failed (exit status $status)"
fi
if (( skipped > 0 )) && [[ "${VMCTL_REQUIRE_VM:-0}" =~ ^(1|true|yes)$ ]]; then
    die "VMCTL_REQUIRE_VM=1 but $skipped VM test(s) were skipped"
fi
if (( skipped > 0 )); then
    say "all tests that ran passed, but $skipped VM test(s) were SKIPPED (see above)"
else
    say "all tests passed"
fi
