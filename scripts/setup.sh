#!/usr/bin/env bash
# Sets everything up on a fresh Debian 12 machine: system packages, access to /dev/kvm,
# vmctl, the guest kernel and the nested host's (`vmctl nested-exec`'s, and the VMs'
# where there is no hardware KVM), the test/hello initramfs, the guest agent, the guest
# root filesystem (Debian + the agent CLIs) and virtiofsd (which serves the workspace
# to the guest), with the AppArmor profile its sandbox needs where AppArmor restricts
# user namespaces (Ubuntu 23.10 and later; through sudo). Idempotent and quiet unless
# something is wrong; the kernel builds (first run only, ~6-10 min each on 2 cores)
# show their progress.
#
#   scripts/setup.sh               everything
#   scripts/setup.sh --skip-vmctl  everything but `cargo build --release -p vmctl`
#
# Afterwards: ./target/release/vmctl exec -- uname -a   (a command in this directory's VM)
#             ./scripts/test.sh             (unit tests + VM tests)
# With hardware KVM, a user who cannot open /dev/kvm is added to its group (through
# sudo), and setup ends asking for a new login, which the group needs to take effect.
# It needs Rust: a cargo at least the release rust-toolchain.toml pins, which rustup
# (https://rustup.rs) fetches on first use; Debian's own cargo is older, and refused
# before anything else runs.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/rootfs-as-root.sh
source "$root/scripts/lib/rootfs-as-root.sh"
# shellcheck source=lib/virtiofsd.sh
source "$root/scripts/lib/virtiofsd.sh"
# shellcheck source=lib/rust-toolchain.sh
source "$root/scripts/lib/rust-toolchain.sh"
packages=(linux-source-6.1 bc flex bison libelf-dev libssl-dev cpio xz-utils gcc g++ libc6-dev
          make qemu-system-x86 busybox-static e2fsprogs mmdebstrap jq git
          libcap-ng-dev libseccomp-dev pkg-config nodejs curl)
# (g++: the fuzz harnesses' libFuzzer; nodejs and curl: vm-bench runs its host-edits
# probe and its HTTPS requests on the host too, as references.)

# The virtiofsd serving workspace shares (crates.io; its build needs libcap-ng and
# libseccomp), installed when vmctl would find none of virtiofsd_min_version or later
# (scripts/lib/virtiofsd.sh).
virtiofsd_version=1.14.0

say() { echo "setup: $*" >&2; }
die() { echo "setup: error: $*" >&2; exit 1; }

build_vmctl=1
for arg in "$@"; do
    case "$arg" in
        --skip-vmctl) build_vmctl=0 ;;
        -h|--help) sed -n '2,/^set /{/^#/p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$arg' (see --help)" ;;
    esac
done

# The PATH vmctl will be run with, for which virtiofsd it finds.
user_path="$PATH"
# rustup installs into ~/.cargo/bin, which non-login shells (CI) may not have on PATH.
if ! command -v cargo >/dev/null && [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
# Before anything that takes minutes: a cargo older than this checkout needs (Debian's
# own) would fail vmctl's build, after the packages, and the guest agent's, after the
# kernels. Under rustup this fetches the pinned release, showing its progress.
if ! rust_problem="$(rust_toolchain_problem "$root")"; then
    die "$rust_problem"
fi

# vmctl's own rule, settled once: the build scripts, run as root with SUDO_UID set
# (`sudo -s`), would otherwise put the root filesystem in the invoking user's cache,
# apart from the kernels and from where vmctl looks.
export VMCTL_CACHE_DIR="${VMCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vmctl}"

log="$(mktemp "${TMPDIR:-/tmp}/vmctl-setup.XXXXXX")"
trap 'rm -f "$log"' EXIT
# Whether sudo will run COMMAND (harmless, standing for what a step runs through it),
# asked once before the step, which would otherwise fail only after its retries, or
# after minutes of other work: with a terminal, sudo may ask for the password there
# (and then remembers it a while); without one (CI, ssh without -t) it must not need
# to. If not, sets sudo_refused to sudo's last line and why.
sudo_works() { # COMMAND...
    local no_terminal=""
    if ( : </dev/tty ) 2>/dev/null; then
        # shellcheck disable=SC2024 # the terminal is this user's, as sudo's prompt is
        sudo "$@" </dev/tty >/dev/null 2>"$log" && return 0
    else
        sudo -n "$@" </dev/null >/dev/null 2>"$log" && return 0
        no_terminal="; there is no terminal for it to ask for a password on"
    fi
    sudo_refused="$(tail -n 1 "$log")"
    sudo_refused="${sudo_refused:-'sudo $*' failed, saying nothing}$no_terminal"
    return 1
}
# Runs a command with its output in the log; shows the log's end if it fails.
quietly() {
    if ! "$@" >"$log" 2>&1 </dev/null; then
        tail -n 30 "$log" >&2
        die "'$*' failed (output above)"
    fi
}

say "[1/8] system packages"
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if (( ${#missing[@]} )); then
    sudo=()
    if [[ $(id -u) != 0 ]]; then
        command -v sudo >/dev/null ||
            die "installing ${missing[*]} needs root: run 'apt-get install ${missing[*]}' as root"
        sudo=(sudo)
        sudo_works apt-get --version ||
            die "installing ${missing[*]} needs root, and sudo refused ($sudo_refused): run setup where sudo can ask for your password (a terminal), or as root, or first run 'apt-get install ${missing[*]}' as root"
    fi
    say "      installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh cloud machine's unattended upgrades may hold dpkg's lock for minutes.
    apt=(apt-get -o DPkg::Lock::Timeout=600)
    # That timeout is dpkg's: `update` takes the package lists' lock without waiting
    # (apt-daily, cloud-init or another setup may be updating), and a mirror may fail
    # for a moment. So it is tried again, for up to 10 minutes.
    for attempt in $(seq 1 20); do
        if "${sudo[@]}" "${apt[@]}" update -q >"$log" 2>&1 </dev/null; then
            break
        fi
        # sudo's own refusal (its remembered password expired, say) is not a mirror's
        # or a lock's moment: no retry.
        if grep -q '^sudo: ' "$log"; then
            tail -n 30 "$log" >&2
            die "installing ${missing[*]} needs root, and sudo refused (output above): run setup where sudo can ask for your password (a terminal), or as root, or first run 'apt-get install ${missing[*]}' as root"
        fi
        if (( attempt == 20 )); then
            tail -n 30 "$log" >&2
            die "'${apt[*]} update' failed 20 times in 10 minutes (output above)"
        fi
        say "      apt-get update failed ($(grep -m1 -E '^(E|W): ' "$log" || tail -n 1 "$log")); trying again in 30 s"
        sleep 30
    done
    quietly "${sudo[@]}" "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}"
fi

# With hardware KVM, vmctl's VMM opens /dev/kvm as whoever runs vmctl (Debian's is
# root:kvm 0660, and an ssh login gets no seat's access to it); the nested host's
# QEMU-TCG needs none. A group added now counts from the next login: said at the end.
hardware_kvm=0
[[ ! -e /sys/module/kvm_intel && ! -e /sys/module/kvm_amd ]] || hardware_kvm=1
kvm_problem=""
if (( ! hardware_kvm )); then
    say "[2/8] access to /dev/kvm: not needed (no hardware KVM: VMs run in the nested host)"
elif [[ ! -e /dev/kvm ]]; then
    say "[2/8] access to /dev/kvm: warning: there is none, although kvm_intel or kvm_amd is loaded (vmctl will say so too)"
elif [[ -r /dev/kvm && -w /dev/kvm ]]; then
    say "[2/8] access to /dev/kvm: ok"
else
    say "[2/8] access to /dev/kvm"
    user="$(id -un)"
    kvm_group="$(stat -c %G /dev/kvm)"
    if [[ "$kvm_group" == root || $(( 8#$(stat -c %a /dev/kvm) & 8#060 )) != $(( 8#060 )) ]]; then
        kvm_problem="/dev/kvm ($(stat -c '%A %U:%G' /dev/kvm)) cannot be opened through a group: give it to group kvm with mode 0660 (what Debian's udev rule does; until the next boot: 'sudo chgrp kvm /dev/kvm && sudo chmod 0660 /dev/kvm'), then rerun setup"
    elif [[ " $(id -nG "$user") " == *" $kvm_group "* ]]; then
        kvm_problem="$user is in group $kvm_group, which may use /dev/kvm, but this login started before that: log in again (or run 'newgrp $kvm_group'), then run vmctl"
    elif command -v sudo >/dev/null; then
        say "      adding $user to group $kvm_group, which may use /dev/kvm (sudo usermod -aG $kvm_group $user)"
        sudo usermod -aG "$kvm_group" "$user" </dev/null ||
            die "'sudo usermod -aG $kvm_group $user' failed: run it as root, log in again, then rerun setup"
        kvm_problem="$user was added to group $kvm_group, which may use /dev/kvm; that counts from the next login: log in again (or run 'newgrp $kvm_group'), then run vmctl"
    else
        kvm_problem="$user cannot open /dev/kvm and there is no sudo: as root, run 'usermod -aG $kvm_group $user'; then log in again and rerun setup"
    fi
fi

if (( build_vmctl )); then
    say "[3/8] vmctl (cargo build --release -p vmctl; ~2 min the first time)"
    # Not quietly: cargo shows its progress (minutes on a fresh machine).
    (cd "$root" && cargo build --release -p vmctl) || die "building vmctl failed (output above)"
else
    say "[3/8] vmctl: skipped (--skip-vmctl)"
fi

say "[4/8] guest kernel and the nested host's (kernel-config/build.sh guest, nested-host; cached)"
kernel="$("$root/kernel-config/build.sh" guest)"
# `vmctl nested-exec` (and its tests) run the nested host wherever QEMU is, hardware
# KVM or not, and without hardware KVM every VM runs in it: built now, not in the
# middle of a command (or under a test's timeout, which would kill it).
nested_kernel=""
if command -v "${VMCTL_QEMU:-qemu-system-x86_64}" >/dev/null || (( ! hardware_kvm )); then
    nested_kernel="$("$root/kernel-config/build.sh" nested-host)"
fi

say "[5/8] initramfs (rootfs/build-initramfs.sh, cached)"
initramfs="$("$root/rootfs/build-initramfs.sh")"

say "[6/8] guest agent (guest-agent/build-initramfs.sh)"
agent="$("$root/guest-agent/build-initramfs.sh")"

say "[7/8] guest root filesystem (rootfs/build-rootfs.sh, cached; ~3 min the first time)"
rootfs_build=("$root/rootfs/build-rootfs.sh")
if [[ ! -f "$("$root/rootfs/build-rootfs.sh" --print-path)" ]]; then
    # Its build needs root (chroot, mmdebstrap's root mode); the image still goes to
    # this user's cache, owned by them.
    rootfs_build_command rootfs_build "$root/rootfs/build-rootfs.sh" ||
        die "building the guest root filesystem needs root, and there is no sudo: run 'VMCTL_CACHE_DIR=$VMCTL_CACHE_DIR ${rootfs_build[0]}' as root (or setup.sh as root)"
    if [[ $(id -u) != 0 ]]; then
        if ! sudo_works true; then
            rootfs_env=()
            rootfs_build_env rootfs_env
            rootfs_as_root="$(rootfs_shown_command env "${rootfs_env[@]}" "$root/rootfs/build-rootfs.sh")"
            die "building the guest root filesystem needs root (chroot, mmdebstrap's root mode), and sudo refused ($sudo_refused): run setup where sudo can ask for your password (a terminal), or as root, or first run '$rootfs_as_root' as root"
        fi
        say "      (as root, through sudo)"
    fi
fi
rootfs="$("${rootfs_build[@]}")"

say "[8/8] virtiofsd $virtiofsd_version (cargo install virtiofsd; ~1.5 min the first time)"
# Where `cargo install` puts it (vmctl looks in ~/.cargo/bin, after PATH).
cargo_virtiofsd="${CARGO_HOME:-$HOME/.cargo}/bin/virtiofsd"
# The one vmctl will run, found with the PATH it will have (not this script's): the
# first virtiofsd_min_version or later, or VMCTL_VIRTIOFSD's, recent or not.
virtiofsd="$(vmctl_virtiofsd "$user_path")"
if [[ -z "$virtiofsd" ]] || ! virtiofsd_is_recent "$virtiofsd"; then
    if ! virtiofsd_is_recent "$cargo_virtiofsd"; then
        # In the checkout, with the cargo checked above (rustup's pinned release).
        quietly env -C "$root" cargo install --locked virtiofsd --version "$virtiofsd_version"
    fi
    virtiofsd="$(vmctl_virtiofsd "$user_path")"
fi
virtiofsd_version_found=""
[[ -z "$virtiofsd" ]] || virtiofsd_version_found="$(virtiofsd_version_line "$virtiofsd")"
virtiofsd_problem=""
if [[ -n "${VMCTL_VIRTIOFSD:-}" ]] && ! virtiofsd_is_recent "$virtiofsd"; then
    virtiofsd_problem="VMCTL_VIRTIOFSD names $virtiofsd (${virtiofsd_version_found:-no version: is it virtiofsd?}), which vmctl refuses: it runs the Rust virtiofsd $virtiofsd_min_version or later. Unset it (vmctl then finds $cargo_virtiofsd, virtiofsd $virtiofsd_version) or set it to $cargo_virtiofsd"
elif [[ -z "$virtiofsd" ]]; then
    # cargo's bin directory is elsewhere (CARGO_HOME) and not on PATH.
    virtiofsd_problem="vmctl finds no virtiofsd $virtiofsd_min_version or later (it looks on PATH, then in ~/.cargo/bin, /usr/libexec, /usr/lib/qemu); cargo installed $cargo_virtiofsd: set VMCTL_VIRTIOFSD=$cargo_virtiofsd where vmctl runs (your shell's profile), or put $(dirname "$cargo_virtiofsd") on PATH"
fi
[[ -z "$virtiofsd_problem" ]] || say "      warning: $virtiofsd_problem"

# Ubuntu 23.10 and later let an unprivileged program make a user namespace but nothing
# inside it unless an AppArmor profile allows it, and virtiofsd's sandbox (vmctl's
# default for a non-root user) makes mount, PID and network namespaces there: every
# share, the workspace's included, would fail to start.
apparmor_problem=""
apparmor_advice="give $virtiofsd the README's AppArmor profile (\"Workspace files (virtio-fs)\"; as root, $virtiofsd_apparmor_file, then 'apparmor_parser -r $virtiofsd_apparmor_file'), or set VMCTL_VIRTIOFSD_SANDBOX=none where vmctl runs, which runs virtiofsd without its sandbox (less safe)"
# (Root's virtiofsd needs no profile: the restriction is on unprivileged programs.)
if [[ $(id -u) != 0 ]] && virtiofsd_is_recent "$virtiofsd" &&
    apparmor_restricts_userns "$apparmor_userns_sysctl"; then
    if [[ "${VMCTL_VIRTIOFSD_SANDBOX:-}" == none ]]; then
        say "      AppArmor restricts user namespaces (kernel.apparmor_restrict_unprivileged_userns=1); VMCTL_VIRTIOFSD_SANDBOX=none runs virtiofsd without the sandbox that needs them: no profile installed"
    elif command -v sudo >/dev/null; then
        say "      AppArmor restricts user namespaces (kernel.apparmor_restrict_unprivileged_userns=1), which virtiofsd's sandbox needs: $virtiofsd gets the README's profile, which allows them ($virtiofsd_apparmor_file, loaded with apparmor_parser -r; through sudo if it is not there yet)"
        if apparmor_done="$(virtiofsd_apparmor_install "$virtiofsd" sudo 2>"$log")"; then
            case "$apparmor_done" in
                "up to date") say "      the profile was there already" ;;
                kept) say "      $virtiofsd_apparmor_file, not setup's, already names $(readlink -f -- "$virtiofsd"): kept" ;;
                *) say "      profile installed and loaded" ;;
            esac
        else
            apparmor_problem="AppArmor restricts user namespaces here, and setup could not give virtiofsd a profile ($(tr '\n' ' ' <"$log")): vmctl cannot start virtiofsd in its sandbox until you $apparmor_advice"
        fi
    else
        apparmor_problem="AppArmor restricts user namespaces here (kernel.apparmor_restrict_unprivileged_userns=1), and without sudo setup cannot install the profile virtiofsd's sandbox needs: vmctl cannot start virtiofsd in its sandbox until you $apparmor_advice"
    fi
    [[ -z "$apparmor_problem" ]] || say "      warning: $apparmor_problem"
fi

say "done"
say "  vmctl:     ${CARGO_TARGET_DIR:-$root/target}/release/vmctl"
say "  kernel:    $kernel"
[[ -z "$nested_kernel" ]] || say "  nested host kernel: $nested_kernel"
say "  initramfs: $initramfs"
say "  agent:     $agent"
say "  rootfs:    $rootfs"
say "  virtiofsd: ${virtiofsd:-none that vmctl would run}${virtiofsd_version_found:+ ($virtiofsd_version_found)}"
[[ -z "$virtiofsd_problem" ]] || say "warning: $virtiofsd_problem"
[[ -z "$apparmor_problem" ]] || say "warning: $apparmor_problem"
# Last, where it is seen, and failing the README's `setup.sh && vmctl exec`, which
# could not open /dev/kvm yet.
[[ -z "$kvm_problem" ]] || die "everything is set up but this login's access to /dev/kvm: $kvm_problem"
