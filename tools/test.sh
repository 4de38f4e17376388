#!/usr/bin/env bash
# The test command (README, .ci/run): sets up what the tests need, then runs all of them.
#
#   tools/test.sh [cargo test arguments...]
#
# The wgpu kernel tests need a Vulkan driver. A machine without a GPU has none unless Mesa's
# lavapipe (a Vulkan driver on the CPU, Debian/Ubuntu package mesa-vulkan-drivers) is
# installed: this script installs it when no driver is present, as root or through sudo, and
# otherwise stops with one line naming the package. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly PACKAGE=mesa-vulkan-drivers

# A Vulkan driver is an ICD manifest (json) the loader finds, plus the loader itself.
has_vulkan_driver() {
  local manifests=${VK_DRIVER_FILES:-${VK_ICD_FILENAMES:-}}
  if [ -n "$manifests" ]; then
    local f
    IFS=: read -r -a files <<<"$manifests"
    for f in "${files[@]}"; do [ -f "$f" ] || return 1; done
  else
    compgen -G "/usr/share/vulkan/icd.d/*.json" >/dev/null ||
      compgen -G "/usr/local/share/vulkan/icd.d/*.json" >/dev/null ||
      compgen -G "/etc/vulkan/icd.d/*.json" >/dev/null || return 1
  fi
  # the loader (libvulkan1); ldconfig is in /sbin, often not on a user's PATH
  PATH="$PATH:/sbin:/usr/sbin" ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1' ||
    compgen -G "/usr/lib*/libvulkan.so.1" >/dev/null ||
    compgen -G "/usr/lib/*/libvulkan.so.1" >/dev/null ||
    compgen -G "/lib/*/libvulkan.so.1" >/dev/null
}

cannot_install() {
  echo "tools/test.sh: no Vulkan driver found for the wgpu tests, and $1: install Mesa's lavapipe" \
    "(package $PACKAGE: sudo apt-get install -y $PACKAGE) or another Vulkan driver, then run" \
    "tools/test.sh again" >&2
  exit 1
}

install_lavapipe() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      sudo="sudo -n"
    else
      cannot_install "this user is not root and cannot use sudo"
    fi
  fi
  command -v apt-get >/dev/null || cannot_install "this system has no apt-get"
  echo "tools/test.sh: no Vulkan driver found; installing $PACKAGE (Mesa's lavapipe)" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$PACKAGE" libvulkan1 ||
    cannot_install "apt-get install $PACKAGE failed"
  has_vulkan_driver || cannot_install "installing $PACKAGE did not make one visible (check VK_DRIVER_FILES / VK_ICD_FILENAMES)"
}

# macOS runs wgpu on Metal, which needs nothing installed.
if [ "$(uname -s)" = Linux ] && ! has_vulkan_driver; then
  install_lavapipe
fi

# wgpu's Vulkan loader warns on every process without a runtime directory.
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
# One test at a time in each test binary: burn 0.21's autodiff lets a backward() in one thread
# free the steps of a graph another thread is building (tracel-ai/burn#5573), so two tests
# with gradients running side by side can lose one silently (seen in CI on 2026-11-27:
# `update::tests::chunked_log_probs_equal_the_unfused_ones`, "gradient on one side only").
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-1}
exec cargo test --workspace "$@"
