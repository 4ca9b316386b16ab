#!/usr/bin/env bash
# Builds the guest root filesystem (an ext4 image, no journal, shared read-only by
# every VM) from a recipe: a Debian base made by mmdebstrap (debootstrap if mmdebstrap
# is absent) plus Debian packages, npm packages installed globally inside the image
# (the coding-agent CLIs) and an optional script run in the image as the last step.
# The image lands in a cache directory keyed by the recipe, its script, the build
# scripts' own text, the Debian suite and the month, and is reused when none of them
# changed: the first start of a month builds an image with Debian's updates (and uses
# the last month's, with a warning, if that build fails). Images of the same recipe
# name unused for 30 days go at the next build. Pin the npm packages' versions in a
# recipe: an unpinned package is at whatever version the month's build finds.
#
#   rootfs/build-rootfs.sh [RECIPE]               build if needed, print the image path
#   rootfs/build-rootfs.sh [RECIPE] --print-path  print where it would be, build nothing
#   rootfs/build-rootfs.sh [RECIPE] --check       build if needed, then mount the image
#                                                 read-only and run its tools
#
# RECIPE defaults to rootfs/recipes/default.recipe (JSON; see rootfs/README.md).
# Needs root (mmdebstrap's root mode, chroot, loop mounts) and the network to Debian's
# mirror and the npm registry; ~3-5 min from nothing on 2 cores. Under sudo, the image
# goes to the invoking user's cache and is theirs.
#
# Environment: VMCTL_CACHE_DIR (default: ${XDG_CACHE_HOME:-~/.cache}/vmctl),
#              VMCTL_BUILD_CA_BUNDLE (CAs that npm/curl in the image trust during the
#              build only; default: this machine's /etc/ssl/certs/ca-certificates.crt),
#              VMCTL_DEBIAN_MIRROR, VMCTL_DEBIAN_SECURITY_MIRROR (default: the Debian
#              ones this machine's apt has fetched from, per `apt-cache policy`; else
#              deb.debian.org),
#              VMCTL_NPM_REGISTRY (default: https://registry.npmjs.org/),
#              VMCTL_ROOTFS_MONTH (YYYY-MM: the month whose image to use or build;
#              default: this month, UTC),
#              VMCTL_ROOTFS_FALLBACK (1: where this month's image cannot be built,
#              print the newest earlier month's, with a warning, as a VM's start does;
#              unset: fail, as an explicit build should).
set -euo pipefail
# mkfs.ext4, chroot and e2fsck are in sbin, which root's PATH lacks after `su` without
# `-` (Debian 12).
for dir in /usr/sbin /sbin; do
    [[ ":$PATH:" == *":$dir:"* ]] || PATH="$PATH:$dir"
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
suite=bookworm
arch=amd64
# shellcheck source=../scripts/lib/cache.sh
source "$here/../scripts/lib/cache.sh"
# shellcheck source=../scripts/lib/debian-mirror.sh
source "$here/../scripts/lib/debian-mirror.sh"
# shellcheck source=../scripts/lib/rootfs-as-root.sh
source "$here/../scripts/lib/rootfs-as-root.sh"

say() { echo "rootfs: $*" >&2; }
die() { echo "rootfs: error: $*" >&2; exit 1; }

recipe="$here/recipes/default.recipe"
action=build
script_args=("$@")
for arg in "$@"; do
    case "$arg" in
        --print-path) action=print ;;
        --check) action=check ;;
        -h|--help) sed -n '2,/^set /{/^#/p}' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option '$arg' (usage: $0 [RECIPE] [--print-path|--check])" ;;
        *) recipe="$arg" ;;
    esac
done

# --- the recipe ----------------------------------------------------------------------
command -v jq >/dev/null || die "'jq' is missing: run 'apt-get install jq' (or scripts/setup.sh)"
[[ -r "$recipe" ]] || die "recipe '$recipe' not found (default: rootfs/recipes/default.recipe)"
recipe="$(cd "$(dirname "$recipe")" && pwd)/$(basename "$recipe")"
# One jq reads and checks the whole recipe: every VM start runs this script, and each
# jq costs some 15 ms. It prints shell assignments, its strings quoted by @sh.
recipe_fields="$(jq -r '
    ["name", "description", "debian_packages", "npm_packages", "script"] as $known
    | if type != "object" then "problem=not_an_object"
      elif (keys - $known | length) > 0 then
          "problem=unknown_fields unknown=" + (keys - $known | join(", ") | @sh)
      elif ((.name | type == "string")
            and ((.debian_packages // []) | type == "array" and all(type == "string"))
            and ((.npm_packages // []) | type == "array" and all(type == "string"))
            and ((.script // "") | type == "string")) | not then "problem=types"
      else "problem=",
           "name=" + (.name | @sh),
           "script_rel=" + ((.script // "") | @sh),
           "debian_packages=(" + ((.debian_packages // []) | @sh) + ")",
           "npm_packages=(" + ((.npm_packages // []) | @sh) + ")"
      end' "$recipe" 2>/dev/null)" || recipe_fields="problem=not_an_object"
problem="" unknown="" name="" script_rel="" debian_packages=() npm_packages=()
eval "$recipe_fields"
case "$problem" in
    not_an_object) die "$recipe is not a JSON object (see rootfs/README.md for the format)" ;;
    unknown_fields) die "$recipe: unknown field(s): $unknown (known: name, description, debian_packages, npm_packages, script)" ;;
    types) die "$recipe: 'name' must be a string, 'debian_packages' and 'npm_packages' arrays of strings, 'script' a string" ;;
esac
[[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "$recipe: name '$name' must match [A-Za-z0-9][A-Za-z0-9._-]*"
for pkg in "${debian_packages[@]}"; do
    [[ "$pkg" =~ ^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+:~-]+)?$ ]] || die "$recipe: '$pkg' is not a Debian package name (pkg or pkg=version)"
done
for pkg in "${npm_packages[@]}"; do
    [[ "$pkg" =~ ^[@A-Za-z0-9][^[:space:]]*$ ]] || die "$recipe: '$pkg' is not an npm package spec"
done
script=""
if [[ -n "$script_rel" ]]; then
    # Relative to the recipe's folder.
    if [[ "$script_rel" == /* ]]; then script="$script_rel"; else script="$(dirname "$recipe")/$script_rel"; fi
    [[ -r "$script" ]] || die "$recipe: script '$script_rel' not found (looked at $script)"
fi

recipe_key="$( { echo "rootfs $(cache_key_of_scripts "${BASH_SOURCE[0]}" "$here/../scripts/lib/debian-mirror.sh") $suite $arch"
          cat "$recipe"; echo
          [[ -z "$script" ]] || cat "$script"; } | sha256sum | cut -c1-16)"
# The month (UTC) whose Debian archive the image holds: the first start of a month
# builds a new image, with the suite's updates since (security fixes among them).
month="${VMCTL_ROOTFS_MONTH:-$(date -u +%Y-%m)}"
[[ "$month" =~ ^[0-9]{4}-(0[1-9]|1[0-2])$ ]] || die "VMCTL_ROOTFS_MONTH='$month' is not a month (YYYY-MM)"
key="$recipe_key-$month"
# Under sudo, the image goes to the invoking user's cache (sudo resets HOME to root's)
# unless VMCTL_CACHE_DIR says where; in a cache of theirs, it is theirs.
invoking_home=""
if [[ -n "${SUDO_UID:-}" && "${SUDO_UID}" != 0 ]]; then
    invoking_home="$(getent passwd "$SUDO_UID" | cut -d: -f6)"
fi
cache_root="${VMCTL_CACHE_DIR:-${invoking_home:+$invoking_home/.cache/vmctl}}"
cache_root="${cache_root:-${XDG_CACHE_HOME:-$HOME/.cache}/vmctl}"
for_user="$(cache_owner "$cache_root")"
out_dir="$cache_root/rootfs/$name-$key"
image="$out_dir/rootfs.ext4"

# --- checking an image: mount it read-only, run its tools ------------------------------
check_image() {
    local mnt rc=0
    [[ $(id -u) == 0 ]] || die "--check mounts the image: run it as root"
    # In a mount namespace of its own, as the build: a check that fails halfway, or is
    # killed, leaves no mount on the host.
    if [[ -z "${VMCTL_ROOTFS_MOUNT_NS:-}" ]] && command -v unshare >/dev/null; then
        VMCTL_ROOTFS_MOUNT_NS=1 VMCTL_ROOTFS_MONTH="$month" \
            exec unshare --mount --propagation private -- "$0" "${script_args[@]}"
    fi
    mnt="$(mktemp -d "${TMPDIR:-/tmp}/vmctl-rootfs-check.XXXXXX")"
    say "checking $image (mounted read-only on $mnt)"
    mount -o loop,ro "$image" "$mnt" || { rmdir "$mnt"; die "cannot mount $image"; }
    # What the guest agent provides in a VM: /proc, /dev and a writable /tmp.
    mount -t proc proc "$mnt/proc"
    mount --bind /dev "$mnt/dev"
    mount -t tmpfs tmpfs "$mnt/tmp"
    mount -t tmpfs tmpfs "$mnt/root"
    chroot "$mnt" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
        /bin/bash -c 'set -e
            for t in bash git python3 node npm curl ssh gcc make rg claude codex; do
                command -v "$t" >/dev/null || { echo "missing: $t"; exit 1; }
            done
            echo "bash:    ${BASH_VERSION}"
            echo "git:     $(git --version)"
            echo "python3: $(python3 --version)"
            echo "node:    $(node --version)   npm: $(npm --version)"
            echo "gcc:     $(gcc --version | head -n1)"
            echo "curl:    $(curl --version | head -n1)"
            echo "rg:      $(rg --version | head -n1)"
            echo "claude:  $(claude --version)"
            echo "codex:   $(codex --version 2>&1 | tail -n1)"
            touch /probe 2>/dev/null && { echo "the root is writable!"; exit 1; } || true' |
        sed 's/^/rootfs:   /' >&2 || rc=$?
    umount "$mnt/root" "$mnt/tmp" "$mnt/dev" "$mnt/proc"
    umount "$mnt"
    rmdir "$mnt"
    [[ $rc == 0 ]] || die "the image at $image failed its check (see the lines above)"
    say "check passed"
}

case "$action" in
    print) echo "$image"; exit 0 ;;
esac
if [[ -f "$image" ]]; then
    cache_mark_used "$out_dir"
    [[ $action != check ]] || check_image
    echo "$image"; exit 0
fi

# month_of IMAGE: the month (YYYY-MM) that ends the name of IMAGE's directory.
month_of() {
    local entry
    entry="$(basename "$(dirname "$1")")"
    echo "${entry: -7}"
}
# The newest image of an earlier month of the recipe, for when this month's cannot be
# built (no root, no network, a mirror down): a VM then starts on it, with a warning.
# Only for a caller that asks (VMCTL_ROOTFS_FALLBACK=1, a VM's start): an explicit
# build (setup.sh, test.sh, `vmctl image build`) fails, and is not put off.
previous_image=""
if [[ $action == build && "${VMCTL_ROOTFS_FALLBACK:-}" == 1 ]]; then
    for candidate in "$cache_root/rootfs/$name-$recipe_key"-????-??/rootfs.ext4; do
        if [[ -f "$candidate" && "$(month_of "$candidate")" < "$month" ]]; then
            previous_image="$candidate"
        fi
    done
fi
# use_previous_image WHY: prints the earlier month's image, saying that this month's
# is not there and WHY, and ends.
use_previous_image() {
    say "warning: using the image of $(month_of "$previous_image"), whose Debian packages lack the updates since: this month's ($month) is not built, as $1"
    cache_mark_used "$(dirname "$previous_image")"
    echo "$previous_image"
    exit 0
}

# --- building --------------------------------------------------------------------------
if [[ $(id -u) != 0 ]]; then
    # What to run instead, as setup.sh and test.sh run it: through sudo, told what its
    # reset environment would lose (this cache, the mirrors, the proxies), quoted.
    as_root=()
    if VMCTL_CACHE_DIR="$cache_root" rootfs_build_command as_root "$0"; then
        suggested="$(rootfs_shown_command "${as_root[@]}" "$@")"
        [[ -z "$previous_image" ]] ||
            use_previous_image "that needs root: run '$suggested' (or scripts/setup.sh) to build it"
        die "building the root filesystem needs root (mmdebstrap's root mode, chroot): run '$suggested' (the image is then yours, in your cache)"
    fi
    VMCTL_CACHE_DIR="$cache_root" rootfs_build_env as_root
    suggested="$(rootfs_shown_command env "${as_root[@]}" "$0" "$@")"
    [[ -z "$previous_image" ]] ||
        use_previous_image "that needs root: as root, run '$suggested' to build it"
    die "building the root filesystem needs root (mmdebstrap's root mode, chroot), and there is no sudo: as root, run '$suggested' (the image is then yours, in your cache)"
fi
# The build's mounts (/proc, /dev in the image tree) live in a mount namespace of its
# own: if the build is killed outright, they go with it, and no later clean-up can
# delete through a bind mount of the host's /dev.
if [[ -z "${VMCTL_ROOTFS_MOUNT_NS:-}" ]] && command -v unshare >/dev/null; then
    # The month read once: a build started at midnight UTC on the 1st builds the image
    # its caller asked for.
    VMCTL_ROOTFS_MOUNT_NS=1 VMCTL_ROOTFS_MONTH="$month" \
        exec unshare --mount --propagation private -- "$0" "$@"
fi
for tool in mkfs.ext4 chroot mount flock sha256sum; do
    command -v "$tool" >/dev/null || die "'$tool' is missing: run scripts/setup.sh"
done
bootstrap=mmdebstrap
if ! command -v mmdebstrap >/dev/null; then
    command -v debootstrap >/dev/null ||
        die "neither mmdebstrap nor debootstrap is installed: run 'apt-get install mmdebstrap' (or scripts/setup.sh)"
    bootstrap=debootstrap
fi

# One build per recipe+key at a time: a second caller waits, then finds the result.
if [[ -n "$for_user" ]]; then
    # The user's cache directories are the user's, whoever makes them first.
    setpriv --reuid="${for_user%:*}" --regid="${for_user#*:}" --init-groups mkdir -p "$cache_root/rootfs" ||
        die "cannot create $cache_root/rootfs as uid $SUDO_UID"
fi
mkdir -p "$cache_root/rootfs"
exec 9>"$cache_root/rootfs/.$name-$key.lock"
# The user's from the start: a build that fails must not leave root's files in their
# cache, where their own builds (a kernel's, as them) could not replace them.
[[ -z "$for_user" ]] || chown "$for_user" "$cache_root/rootfs/.$name-$key.lock"
if ! flock -n 9; then
    say "another build of $name-$key is running; waiting for it"
    flock 9
fi
if [[ -f "$image" ]]; then
    [[ $action != check ]] || check_image
    echo "$image"; exit 0
fi
# A month's build that failed less than an hour ago is not tried again at each start
# meanwhile (each would take minutes to fail as well): the earlier month's image does.
failed_log="$cache_root/rootfs/$name-$key.failed.log"
if [[ -n "$previous_image" ]] &&
        [[ -n "$(find "$failed_log" -maxdepth 0 -mmin -60 2>/dev/null)" ]]; then
    use_previous_image "its build failed less than an hour ago (log: $failed_log); the next start after that tries again, and '$0 ${script_args[*]}' now"
fi

# The Debian mirrors this machine's apt uses, else Debian's CDN.
mirror="${VMCTL_DEBIAN_MIRROR:-$(debian_mirror "$suite" Debian)}"
mirror="${mirror:-http://deb.debian.org/debian}"
security_mirror="${VMCTL_DEBIAN_SECURITY_MIRROR:-$(debian_mirror "$suite-security" Debian-Security)}"
security_mirror="${security_mirror:-http://deb.debian.org/debian-security}"
npm_registry="${VMCTL_NPM_REGISTRY:-https://registry.npmjs.org/}"

# One work directory per image, cleared under the lock: what a build killed outright
# left behind goes at the next one.
work="$cache_root/rootfs/build.$name-$key"
heartbeat=""
# Never rm -rf through a mount: unmount whatever is left under the work dir first.
unmount_all() {
    local m
    while read -r m; do umount -l "$m" 2>/dev/null || true; done < <(
        findmnt -rn -o TARGET 2>/dev/null | awk -v w="$work/" 'index($0, w) == 1' | sort -r)
}
cleanup() {
    [[ -z "$heartbeat" ]] || stop_heartbeat
    unmount_all
    rm -rf --one-file-system "$work" "$out_dir.tmp"
}
if [[ -e "$work" ]]; then
    say "removing what an interrupted build left in $work"
    cleanup
fi
mkdir -p "$work"
root="$work/root"
log="$work/build.log"
on_exit() {
    local rc=$?
    # A failure's log is kept, and says when the build last failed (failed_log).
    [[ $rc == 0 || $rc == 130 ]] || kept_log >/dev/null
    # A clean-up that fails (a mount left) must not keep the earlier image from the start.
    cleanup || say "warning: could not clear $work"
    if [[ $rc != 0 && $rc != 130 && -n "$previous_image" && ! -f "$image" ]]; then
        use_previous_image "its build failed (above); a start an hour from now tries again"
    fi
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# Prints a line every 20 s while a long step runs: elapsed time and the tree's size.
# It ends with the build: a build killed outright (SIGKILL) must not leave it holding
# the build's lock (fd 9), which every later build would wait for, nor the caller's
# output, whose end the caller waits for.
start_heartbeat() { # label
    local label="$1" t0 build=$$
    t0="$(date +%s)"
    (
        exec 9>&-
        s=""
        trap '[[ -z "$s" ]] || kill "$s" 2>/dev/null; exit 0' TERM
        while kill -0 "$build" 2>/dev/null; do
            sleep 20 & s=$!
            wait "$s"
            kill -0 "$build" 2>/dev/null || exit 0
            say "      ... $label: $(( $(date +%s) - t0 )) s, image tree $(du -sxm "$root" 2>/dev/null | cut -f1) MB"
        done
    ) &
    heartbeat=$!
}
stop_heartbeat() {
    kill "$heartbeat" 2>/dev/null || true
    wait "$heartbeat" 2>/dev/null || true
    heartbeat=""
}
# For a failure's message: copies the build's log, which goes with the work directory
# when the build ends, to where it stays until the next successful build (the user's);
# prints that path.
kept_log() {
    local kept="$cache_root/rootfs/$name-$key.failed.log"
    cp "$log" "$kept" 2>/dev/null || : >"$kept" 2>/dev/null || true
    [[ -z "$for_user" ]] || chown "$for_user" "$kept" 2>/dev/null || true
    echo "$kept"
}
# Runs a command with its output in the log; shows the log's end if it fails.
logged() { # description, command...
    local what="$1"; shift
    echo "### $*" >>"$log"
    if ! "$@" >>"$log" 2>&1 </dev/null; then
        [[ -z "$heartbeat" ]] || stop_heartbeat
        tail -n 40 "$log" >&2
        die "$what failed (output above; full log: $(kept_log))"
    fi
}
# Runs a command in the image with /proc, /dev and the host's DNS (for apt/npm).
# TLS trusts the build host's CA bundle (copied to /tmp for the build only, not kept):
# where egress goes through an intercepting proxy, the image's own CAs would not do.
build_ca=/tmp/vmctl-build-ca.crt
in_root() {
    local ca=() proxy=() var
    [[ ! -f "$root$build_ca" ]] || ca=(NODE_EXTRA_CA_CERTS="$build_ca" npm_config_cafile="$build_ca"
        SSL_CERT_FILE="$build_ca" CURL_CA_BUNDLE="$build_ca" GIT_SSL_CAINFO="$build_ca"
        PIP_CERT="$build_ca" REQUESTS_CA_BUNDLE="$build_ca")
    for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
        [[ -z "${!var:-}" ]] || proxy+=("$var=${!var}")
    done
    chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "${ca[@]}" "${proxy[@]}" "$@"
}

t_start="$(date +%s)"
say "building '$name' ($recipe) into $out_dir (~3-5 min from nothing; cached afterwards)"
[[ -z "$previous_image" ]] ||
    say "(a new month's image: the one of $(month_of "$previous_image") lacks Debian's updates since)"

# Documentation, man pages and translations are of no use in a VM: dpkg skips them
# (copyright files stay).
dpkg_excludes=(path-exclude=/usr/share/man/* path-exclude=/usr/share/info/*
               path-exclude=/usr/share/doc/* path-include=/usr/share/doc/*/copyright
               path-exclude=/usr/share/locale/* path-include=/usr/share/locale/locale.alias
               path-exclude=/usr/share/lintian/* path-exclude=/usr/share/linda/*)
include="$(IFS=,; echo "${debian_packages[*]}")"
say "[1/6] Debian $suite base ($bootstrap --variant=minbase) + ${#debian_packages[@]} packages from $mirror"
start_heartbeat "$bootstrap"
if [[ $bootstrap == mmdebstrap ]]; then
    opts=(--mode=root --format=directory --variant=minbase --architectures="$arch"
          --aptopt='Acquire::Retries "3"' --aptopt='Acquire::Languages "none"')
    for e in "${dpkg_excludes[@]}"; do opts+=(--dpkgopt="$e"); done
    [[ -z "$include" ]] || opts+=(--include="$include")
    logged "$bootstrap" mmdebstrap "${opts[@]}" "$suite" "$root" \
        "deb $mirror $suite main" "deb $mirror $suite-updates main" \
        "deb $security_mirror $suite-security main"
else
    mkdir -p "$root/etc/dpkg/dpkg.cfg.d"
    printf '%s\n' "${dpkg_excludes[@]}" >"$root/etc/dpkg/dpkg.cfg.d/vmctl-excludes"
    logged "$bootstrap" debootstrap --variant=minbase --arch="$arch" ${include:+--include="$include"} \
        "$suite" "$root" "$mirror"
    cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security_mirror $suite-security main
EOF
fi
stop_heartbeat
# (mmdebstrap keeps its --dpkgopt options in /etc/dpkg/dpkg.cfg.d/99mmdebstrap, so
# packages a recipe's script installs skip the documentation too.)
# The guest's PID 1 is vmctl's agent: nothing may have pulled in an init system.
for pkg in systemd systemd-sysv sysvinit-core; do
    if chroot "$root" dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        die "the recipe pulled in '$pkg' (an init system); the guest's PID 1 is vmctl's agent: drop the package that depends on it"
    fi
done
say "      base done after $(( $(date +%s) - t_start )) s ($(du -sxm "$root" | cut -f1) MB)"

mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
rm -f "$root/etc/resolv.conf"
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
host_ca="${VMCTL_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
[[ ! -r "$host_ca" ]] || cp -L "$host_ca" "$root$build_ca"

if (( ${#npm_packages[@]} )); then
    say "[2/6] npm install -g --prefix /usr/local ${npm_packages[*]} (in the image, with its node $(chroot "$root" node --version 2>/dev/null || echo '(none)'))"
    chroot "$root" npm --version >/dev/null 2>&1 ||
        die "npm_packages need npm in the image: add 'nodejs' and 'npm' to debian_packages"
    start_heartbeat "npm install"
    # The image's own npm (Debian's) does the install, so paths, shebangs and native
    # binaries match the image; --foreground-scripts shows the postinstall output.
    # A registry's moment of failure must not cost the whole build: more retries than
    # npm's two.
    logged "npm install" in_root npm install -g --prefix /usr/local --registry "$npm_registry" \
        --fetch-retries=6 --no-audit --no-fund --no-update-notifier --foreground-scripts \
        --loglevel=http "${npm_packages[@]}"
    stop_heartbeat
    # Debian's npm 9 does not know the 'libc' field of optional dependencies, so it
    # installs musl builds of native binaries next to the glibc ones: drop those that
    # have a glibc sibling (the postinstall scripts picked the glibc one).
    while IFS= read -r -d '' musl; do
        if [[ -d "${musl%-musl}" ]]; then
            rm -rf "$musl"
            say "      removed ${musl#"$root"} (musl build; the image is glibc)"
        fi
    done < <(find "$root/usr/local/lib/node_modules" -type d -name '*-linux-*-musl' -print0)
    rm -rf "$root/root/.npm"
    say "      npm done ($(du -sxm "$root/usr/local" | cut -f1) MB in /usr/local)"
else
    say "[2/6] npm packages: none"
fi

if [[ -n "$script" ]]; then
    say "[3/6] running the recipe's script ${script#"$here/"} in the image"
    cp "$script" "$root/tmp/vmctl-recipe-script"
    start_heartbeat "recipe script"
    logged "the recipe's script ($script)" in_root /bin/bash /tmp/vmctl-recipe-script
    stop_heartbeat
    rm -f "$root/tmp/vmctl-recipe-script"
else
    say "[3/6] recipe script: none"
fi

say "[4/6] checking the tools in the image"
versions="$work/versions"
# Known agent CLIs must answer --version; every other npm package at least has its bins.
declare -A cli_of=([@anthropic-ai/claude-code]=claude [@openai/codex]=codex)
checks=(git python3 node)
for pkg in "${npm_packages[@]}"; do
    base="${pkg%@*}"; [[ -n "$base" ]] || base="$pkg"
    [[ -z "${cli_of[$base]:-}" ]] || checks+=("${cli_of[$base]}")
done
: >"$versions"
for tool in "${checks[@]}"; do
    path="$(chroot "$root" /bin/sh -c "PATH=/usr/local/bin:/usr/bin:/bin command -v $tool" || true)"
    [[ -n "$path" ]] || { if [[ $tool == git || $tool == python3 || $tool == node ]]; then continue; fi
                           die "'$tool' is not in the image after installing its npm package (the build's log: $(kept_log))"; }
    if ! out="$(in_root "$path" --version 2>&1 </dev/null)"; then
        echo "$out" | tail -n 20 >&2
        die "'$tool --version' fails in the image (output above)"
    fi
    # The last line: codex prints warnings before its version.
    echo "$tool: $(echo "$out" | tail -n1)" | tee -a "$versions" | sed 's/^/rootfs:       /' >&2
done
claude_bin="$root/usr/local/lib/node_modules/@anthropic-ai/claude-code/bin/claude.exe"
if [[ -f "$claude_bin" ]]; then
    interp="$(readelf -l "$claude_bin" 2>/dev/null | sed -n 's/.*interpreter: \(.*\)]/\1/p' || true)"
    [[ "$interp" == */ld-linux-x86-64.so.2 ]] ||
        die "claude's native binary is not the linux-x64 glibc build (interpreter: '${interp:-none}')"
fi

say "[5/6] trimming and configuring for a VM"
umount "$root/dev" "$root/proc"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
       "$root"/var/cache/man "$root"/var/cache/ldconfig/aux-cache "$root"/var/log/* \
       "$root"/root/.npm "$root"/root/.cache "$root"/root/.codex "$root"/root/.claude* \
       "$root"/tmp/* "$root"/var/tmp/* \
       "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/lintian \
       "$root"/var/lib/dpkg/*-old
find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} + 2>/dev/null || true
mkdir -p "$root/var/lib/apt/lists/partial"
# /dev is the guest kernel's devtmpfs; nothing of the build host belongs there.
find "$root/dev" -mindepth 1 -delete
echo vmctl >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost vmctl\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
# No network device in the guest: HTTP(S) goes through a proxy the agent sets up.
echo "# no nameserver: the VM has no network device; HTTP(S) goes through vmctl's proxy" >"$root/etc/resolv.conf"
: >"$root/etc/machine-id"
{
    echo "name=$name"
    echo "key=$key"
    echo "month=$month"
    echo "suite=$suite"
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    cat "$versions"
} >"$root/etc/vmctl-rootfs"

say "[6/6] making the ext4 image"
used_kb="$(du -sxk "$root" | cut -f1)"
files="$(find "$root" -xdev | wc -l)"
inodes=$(( files + files / 10 + 1024 ))
# Content + ~10%, plus the inode tables (256 bytes each) and some room for metadata.
size_kb=$(( used_kb + used_kb / 10 + inodes / 4 + 16384 ))
mkdir -p "$out_dir.tmp"
for attempt in 1 2 3; do
    rm -f "$out_dir.tmp/rootfs.ext4"
    truncate -s "${size_kb}K" "$out_dir.tmp/rootfs.ext4"
    if mkfs.ext4 -q -F -t ext4 -b 4096 -L vmctl-root -m 0 -O ^has_journal -N "$inodes" \
            -E root_owner=0:0 -d "$root" "$out_dir.tmp/rootfs.ext4" >>"$log" 2>&1; then
        break
    fi
    (( attempt < 3 )) || { tail -n 20 "$log" >&2; die "mkfs.ext4 failed (output above; full log: $(kept_log))"; }
    size_kb=$(( size_kb + size_kb / 10 ))
    say "      image too small; retrying with $(( size_kb / 1024 )) MiB"
done
e2fsck -fn "$out_dir.tmp/rootfs.ext4" >>"$log" 2>&1 ||
    { tail -n 20 "$log" >&2; die "the new image fails e2fsck (output above; full log: $(kept_log))"; }

# Records of what is inside, next to the image.
cp "$recipe" "$out_dir.tmp/recipe.json"
[[ -z "$script" ]] || cp "$script" "$out_dir.tmp/recipe-script.sh"
cp "$root/etc/vmctl-rootfs" "$out_dir.tmp/info"
chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' >"$out_dir.tmp/debian-packages.txt"
if [[ -d "$root/usr/local/lib/node_modules" ]]; then
    for p in "$root"/usr/local/lib/node_modules/{*,@*/*}/package.json; do
        [[ -f "$p" ]] && jq -r '"\(.name) \(.version)"' "$p"
    done >"$out_dir.tmp/npm-packages.txt"
fi
rm -rf "$out_dir" "$cache_root/rootfs/$name-$key.failed.log"
if [[ -n "$for_user" ]]; then
    chown -R "$for_user" "$out_dir.tmp"
fi
cache_publish "$out_dir.tmp" "$out_dir" rootfs.ext4
cache_prune "$cache_root/rootfs" "$name-????????????????-????-??" "$out_dir"
# Images named before keys held their month: all superseded by this one.
cache_keep_older=0 cache_prune "$cache_root/rootfs" "$name-????????????????" ""

elapsed=$(( $(date +%s) - t_start ))
say "done in $(( elapsed / 60 )) min $(( elapsed % 60 )) s: $image" \
    "($(( $(stat -c %s "$image") / 1048576 )) MiB; $(( used_kb / 1024 )) MiB of files)"
[[ $action != check ]] || check_image
echo "$image"
