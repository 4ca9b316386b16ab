# shellcheck shell=bash
# Shared by setup.sh and test.sh (sourced, not run): how they have a guest root
# filesystem built, whose build needs root (chroot, mmdebstrap's root mode).

# rootfs_build_command ARRAY SCRIPT: sets the array named ARRAY to the command that runs
# the root filesystem's build script SCRIPT (recipe arguments follow it): SCRIPT itself
# for root; else SCRIPT through sudo, told what sudo's reset environment would lose
# (VMCTL_CACHE_DIR, which must be set, the mirrors, the proxies), so that the image
# still goes to this user's cache and is theirs. Returns 1 when that needs sudo and
# there is none.
# shellcheck disable=SC2034 # rootfs_build_command_out refers to the caller's array
rootfs_build_command() {
    local -n rootfs_build_command_out="$1"
    local script="$2" var pass_on
    if [[ $(id -u) == 0 ]]; then
        rootfs_build_command_out=("$script")
        return 0
    fi
    command -v sudo >/dev/null || return 1
    pass_on=("VMCTL_CACHE_DIR=${VMCTL_CACHE_DIR:?}")
    for var in VMCTL_BUILD_CA_BUNDLE VMCTL_DEBIAN_MIRROR VMCTL_DEBIAN_SECURITY_MIRROR \
               VMCTL_NPM_REGISTRY http_proxy https_proxy no_proxy; do
        [[ -z "${!var:-}" ]] || pass_on+=("$var=${!var}")
    done
    rootfs_build_command_out=(sudo env "${pass_on[@]}" "$script")
}
