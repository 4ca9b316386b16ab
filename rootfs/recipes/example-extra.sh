#!/bin/bash
# Runs inside the image (chrooted, as root) after the Debian and npm packages, before
# the image is trimmed: apt lists and the network are still there. A failure fails
# the build.
set -euo pipefail

# An unprivileged user for agents (Claude Code refuses to skip its permission
# prompts as root).
useradd --create-home --uid 1000 --shell /bin/bash agent
git config --system init.defaultBranch main
git config --system safe.directory '*'

# Check what the recipe added.
jq --version
tsc --version
