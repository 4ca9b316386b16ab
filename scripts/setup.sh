#!/usr/bin/env bash
# Sets everything up on a fresh Debian 12 machine: system packages, vmctl, the guest
# kernel (and the nested host's, where there is no hardware KVM) and the test/hello
# initramfs, the guest agent, the guest root filesystem (Debian + the agent CLIs) and
# virtiofsd (which serves the workspace to the guest).
# Idempotent and quiet unless something is wrong;
# the kernel build (first run only, ~6-10 min on 2 cores) shows its progress.
#
#   scripts/setup.sh               everything
#   scripts/setup.sh --skip-vmctl  everything but `cargo build --release -p vmctl`
#
# Afterwards: ./target/release/vmctl exec -- uname -a   (a command in this directory's VM)
#             ./scripts/test.sh             (unit tests + VM tests)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
packages=(linux-source-6.1 bc flex bison libelf-dev libssl-dev cpio xz-utils gcc g++ libc6-dev
          make qemu-system-x86 busybox-static e2fsprogs mmdebstrap jq git
          libcap-ng-dev libseccomp-dev pkg-config nodejs curl)
# (g++: the fuzz harnesses' libFuzzer; nodejs and curl: vm-bench runs its host-edits
# probe and its HTTPS requests on the host too, as references.)

# The virtiofsd serving workspace shares (crates.io; its build needs libcap-ng and
# libseccomp).
virtiofsd_version=1.14.0

say() { echo "setup: $*" >&2; }
die() { echo "setup: error: $*" >&2; exit 1; }

build_vmctl=1
for arg in "$@"; do
    case "$arg" in
        --skip-vmctl) build_vmctl=0 ;;
        -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$arg' (see --help)" ;;
    esac
done

# rustup installs into ~/.cargo/bin, which non-login shells (CI) may not have on PATH.
if ! command -v cargo >/dev/null && [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi

# vmctl's own rule, settled once: the build scripts, run as root with SUDO_UID set
# (`sudo -s`), would otherwise put the root filesystem in the invoking user's cache,
# apart from the kernels and from where vmctl looks.
export VMCTL_CACHE_DIR="${VMCTL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vmctl}"

log="$(mktemp "${TMPDIR:-/tmp}/vmctl-setup.XXXXXX")"
trap 'rm -f "$log"' EXIT
# Runs a command with its output in the log; shows the log's end if it fails.
quietly() {
    if ! "$@" >"$log" 2>&1 </dev/null; then
        tail -n 30 "$log" >&2
        die "'$*' failed (output above)"
    fi
}

say "[1/7] system packages"
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
    fi
    say "      installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh cloud machine's unattended upgrades may hold dpkg's lock for minutes.
    apt=(apt-get -o DPkg::Lock::Timeout=600)
    quietly "${sudo[@]}" "${apt[@]}" update -q
    quietly "${sudo[@]}" "${apt[@]}" install -y -q --no-install-recommends "${missing[@]}"
fi

if (( build_vmctl )); then
    say "[2/7] vmctl (cargo build --release -p vmctl; ~2 min the first time)"
    command -v cargo >/dev/null ||
        die "cargo is missing: install the Rust toolchain (https://rustup.rs), then rerun"
    # Not quietly: cargo shows its progress (minutes on a fresh machine).
    (cd "$root" && cargo build --release -p vmctl) || die "building vmctl failed (output above)"
else
    say "[2/7] vmctl: skipped (--skip-vmctl)"
fi

say "[3/7] guest kernel (kernel-config/build.sh guest, cached)"
kernel="$("$root/kernel-config/build.sh" guest)"
# Without hardware KVM, vmctl runs its VMM inside the QEMU-TCG nested host, which
# boots its own kernel flavour.
nested_kernel=""
if [[ ! -e /sys/module/kvm_intel && ! -e /sys/module/kvm_amd ]]; then
    say "      no hardware KVM here: also the nested host's kernel (build.sh nested-host)"
    nested_kernel="$("$root/kernel-config/build.sh" nested-host)"
fi

say "[4/7] initramfs (rootfs/build-initramfs.sh, cached)"
initramfs="$("$root/rootfs/build-initramfs.sh")"

say "[5/7] guest agent (guest-agent/build-initramfs.sh)"
agent="$("$root/guest-agent/build-initramfs.sh")"

say "[6/7] guest root filesystem (rootfs/build-rootfs.sh, cached; ~3 min the first time)"
rootfs_build=("$root/rootfs/build-rootfs.sh")
if [[ $(id -u) != 0 && ! -f "$("$root/rootfs/build-rootfs.sh" --print-path)" ]]; then
    # Its build needs root (chroot, mmdebstrap's root mode); the image still goes to
    # this user's cache, owned by them.
    command -v sudo >/dev/null ||
        die "building the guest root filesystem needs root: run 'sudo ${rootfs_build[0]}' (or setup.sh as root)"
    say "      (as root, through sudo)"
    # sudo drops the environment: pass on where the cache is and how to reach the
    # mirrors.
    pass_on=("VMCTL_CACHE_DIR=$VMCTL_CACHE_DIR")
    for var in VMCTL_BUILD_CA_BUNDLE VMCTL_DEBIAN_MIRROR VMCTL_DEBIAN_SECURITY_MIRROR \
               VMCTL_NPM_REGISTRY http_proxy https_proxy no_proxy; do
        [[ -z "${!var:-}" ]] || pass_on+=("$var=${!var}")
    done
    rootfs_build=(sudo env "${pass_on[@]}" "${rootfs_build[0]}")
fi
rootfs="$("${rootfs_build[@]}")"

say "[7/7] virtiofsd $virtiofsd_version (cargo install virtiofsd; ~1.5 min the first time)"
virtiofsd="$(command -v virtiofsd || echo "$HOME/.cargo/bin/virtiofsd")"
if [[ "$("$virtiofsd" --version 2>/dev/null)" != "virtiofsd $virtiofsd_version" ]]; then
    quietly cargo install --locked virtiofsd --version "$virtiofsd_version"
    virtiofsd="$HOME/.cargo/bin/virtiofsd"
fi

say "done"
say "  vmctl:     ${CARGO_TARGET_DIR:-$root/target}/release/vmctl"
say "  kernel:    $kernel"
[[ -z "$nested_kernel" ]] || say "  nested host kernel: $nested_kernel"
say "  initramfs: $initramfs"
say "  agent:     $agent"
say "  rootfs:    $rootfs"
say "  virtiofsd: $virtiofsd"
