# shellcheck shell=bash
# Shared by the root filesystem's build (sourced, not run): which Debian mirror this
# machine's apt uses, so that the image's packages come from where the host's do (a
# nearby or internal mirror, one the firewall allows).

# debian_mirror SUITE LABEL: prints the URL of the Debian-origin repository (o=Debian)
# whose main component apt on this machine has for SUITE (e.g. bookworm,
# bookworm-security), else of any with the release label LABEL (Debian,
# Debian-Security; a host of another Debian release); nothing if there is none. Reads
# `apt-cache policy` (what apt has fetched, not what a sources file says), so a
# third-party repository whose URL merely ends in /debian (Docker's, MongoDB's) is never
# taken for Debian's; nor is an apt-only scheme (mirror+file:, tor+http:) that the
# image's own apt could not follow.
debian_mirror() {
    LC_ALL=C apt-cache policy 2>/dev/null | debian_mirror_from_policy "$1" "$2"
}

# debian_mirror_from_policy SUITE LABEL: debian_mirror's choice, from `apt-cache policy`
# output on stdin.
debian_mirror_from_policy() {
    awk -v suite="$1" -v label="$2" '
        # " 500 http://deb.debian.org/debian bookworm/main amd64 Packages"
        /^ *-?[0-9]+ / { url = $2; next }
        # "     release v=12.5,o=Debian,a=stable,n=bookworm,l=Debian,c=main,b=amd64"
        /^ +release / {
            if (url !~ /^(https?:\/\/|file:\/)/) { url = ""; next }
            delete field
            count = split(substr($0, index($0, "release ") + 8), pairs, ",")
            for (i = 1; i <= count; i++) {
                eq = index(pairs[i], "=")
                if (eq > 0) field[substr(pairs[i], 1, eq - 1)] = substr(pairs[i], eq + 1)
            }
            if (field["o"] == "Debian" && field["c"] == "main") {
                if (field["n"] == suite) { exact = url; exit }
                if (field["l"] == label && fallback == "") fallback = url
            }
            url = ""
        }
        END {
            chosen = exact != "" ? exact : fallback
            sub(/\/+$/, "", chosen)
            if (chosen != "") print chosen
        }'
}
