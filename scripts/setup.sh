#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian/Ubuntu (as root or with sudo) or macOS:
# redis-server, the system OpenBLAS (Linux: 30x faster MLX CPU matmuls), python3 with venv,
# Chromium (Linux: the web page's tests run it headless), and the project in .venv. Safe to run again: it only installs what is missing.
# Sourced by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "need root (or sudo) to run: $*" >&2; exit 1; fi
}

install_system_packages() {
  case "$(uname -s)" in
    Linux)
      local missing=()
      command -v redis-server >/dev/null || missing+=(redis-server)
      ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || missing+=(libopenblas0-pthread)
      command -v python3 >/dev/null || missing+=(python3)
      python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
      # tests/test_netns.py puts a worker in a network namespace of its own (as root).
      [ "$(id -u)" != 0 ] || command -v ip >/dev/null || missing+=(iproute2)
      # The web page's tests drive a headless Chromium (tests/browser.py).
      command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
      if [ ${#missing[@]} -gt 0 ]; then
        command -v apt-get >/dev/null || { echo "please install: ${missing[*]}" >&2; exit 1; }
        say "installing ${missing[*]} (apt)"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
      fi ;;
    Darwin)
      command -v brew >/dev/null || { echo "please install Homebrew (https://brew.sh) first" >&2; exit 1; }
      command -v redis-server >/dev/null || { say "installing redis (brew)"; brew install redis; }
      command -v python3 >/dev/null || { say "installing python (brew)"; brew install python; }
      [ -d /Applications/Chromium.app ] || command -v chromium >/dev/null ||
        { say "installing chromium (brew, for the web page's tests)"; brew install --cask chromium; } ;;
    *) echo "unsupported OS: $(uname -s)" >&2; exit 1 ;;
  esac
}

install_python_env() {
  python3 -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 is needed"'
  [ -x .venv/bin/python ] || { say "creating .venv"; python3 -m venv .venv; }
  # Reinstall only when pyproject.toml changed since the last install.
  local stamp=.venv/.mtq-installed
  if [ ! -f "$stamp" ] || ! cmp -s pyproject.toml "$stamp"; then
    say "installing the project and its pinned dependencies into .venv"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    cp pyproject.toml "$stamp"
  fi
}

install_system_packages
install_python_env
