#!/usr/bin/env bash
# Regenerate requirements/cpu.lock, the exact CPU environment scripts/setup.sh installs: a throw-away venv gets
# the newest versions pyproject.toml allows (torch 2.13.0 CPU first, as setup.sh does), and pip freeze pins
# them. Run after changing pyproject.toml's dependencies, then `make test` and commit the lock with the change.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m venv "$tmp/venv"
PIP=("$tmp/venv/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "torch==2.13.0"
"${PIP[@]}" install -q ".[cpu,test]"
"${PIP[@]}" uninstall -q -y rollmatch torchvision torchaudio torchcodec >/dev/null 2>&1 || true
{
  echo "# The CPU environment that make setup, make test and CI install, exactly (pip constraints: every package"
  echo "# the project pulls in, pinned). Regenerate with scripts/lock.sh after changing pyproject.toml's dependencies."
  "${PIP[@]}" freeze --exclude-editable
} > requirements/cpu.lock
echo "requirements/cpu.lock: $(grep -vc '^#' requirements/cpu.lock) packages pinned"
