#!/usr/bin/env bash
# Offline fallback for lessons 1-3: Debian's package dataset-fashion-mnist puts Fashion-MNIST
# (same IDX format and shapes as MNIST) under /usr/share/datasets/fashion-mnist. Installed where
# apt-get is usable as root (as in CI); elsewhere torchvision downloads MNIST as usual.
# Never fails: the scripts say what to do if no dataset can be found.
set -u
dir=/usr/share/datasets/fashion-mnist
[ -d "$dir" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's dataset-fashion-mnist (offline fallback for MNIST) ..."
    if ! apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; then
        apt-get update -qq >/dev/null 2>&1
        apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
            || echo "note: could not install dataset-fashion-mnist; the scripts will download MNIST"
    fi
else
    echo "note: $dir is absent (not root or no apt-get); the scripts will download MNIST (needs internet)"
fi
exit 0
