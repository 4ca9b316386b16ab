# shellcheck shell=bash
# Shared by setup.sh, test.sh and rootfs/build-rootfs.sh (sourced, not run): how a
# guest root filesystem is built, whose build needs root (chroot, mmdebstrap's root
# mode), by a user who is not root.

# rootfs_build_env ARRAY: sets the array named ARRAY to the VAR=VALUE words the build
# needs from this environment and that sudo's reset environment (or `su -`) would lose:
# VMCTL_CACHE_DIR, which must be set, so that the image still goes to this user's cache
# and is theirs, and whichever of the CA bundle, the mirrors, the npm registry, the
# image's month and the proxies are set.
# shellcheck disable=SC2034 # rootfs_build_env_out refers to the caller's array
rootfs_build_env() {
    local -n rootfs_build_env_out="$1"
    local var
    rootfs_build_env_out=("VMCTL_CACHE_DIR=${VMCTL_CACHE_DIR:?}")
    for var in VMCTL_BUILD_CA_BUNDLE VMCTL_DEBIAN_MIRROR VMCTL_DEBIAN_SECURITY_MIRROR \
               VMCTL_NPM_REGISTRY VMCTL_ROOTFS_MONTH http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
        [[ -z "${!var:-}" ]] || rootfs_build_env_out+=("$var=${!var}")
    done
}

# rootfs_build_command ARRAY SCRIPT: sets the array named ARRAY to the command that runs
# the root filesystem's build script SCRIPT (recipe arguments follow it): SCRIPT itself
# for root; else SCRIPT through sudo, told what sudo's reset environment would lose
# (rootfs_build_env). Returns 1 when that needs sudo and there is none.
# shellcheck disable=SC2034 # rootfs_build_command_out refers to the caller's array
rootfs_build_command() {
    local -n rootfs_build_command_out="$1"
    local script="$2" pass_on
    if [[ $(id -u) == 0 ]]; then
        rootfs_build_command_out=("$script")
        return 0
    fi
    command -v sudo >/dev/null || return 1
    rootfs_build_env pass_on
    rootfs_build_command_out=(sudo env "${pass_on[@]}" "$script")
}

# rootfs_shown_command WORD...: the command WORD... as one line to copy into a shell,
# each word quoted (printf %q), but a VAR=VALUE whose value holds a password (a proxy's
# scheme://user:password@host) shown as VAR="$VAR": a message must not print it, and
# the shell the user pastes into has it.
rootfs_shown_command() {
    local word shown=()
    for word in "$@"; do
        if [[ "$word" =~ ^([A-Za-z_][A-Za-z0-9_]*)=[A-Za-z][A-Za-z0-9+.-]*://[^/@]*:[^/@]*@ ]]; then
            shown+=("${BASH_REMATCH[1]}=\"\$${BASH_REMATCH[1]}\"")
        else
            shown+=("$(printf '%q' "$word")")
        fi
    done
    echo "${shown[*]}"
}
