"""The config schema and the registries import no heavy module: torch, cv2 and albumentations unimportable,
syncseg.engine.config still loads and validates a shipped config (issue 29 item 3)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "torchvision", "cv2", "albumentations")

# A meta-path finder that refuses the heavy packages (and their submodules), as if they were not installed
BLOCKER = f"""
import sys
from importlib.abc import MetaPathFinder

class Refuse(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ImportError(f"{{name}} is blocked by the test")
        return None

sys.meta_path.insert(0, Refuse())
"""

PROGRAM = BLOCKER + """
import syncseg.data.registry, syncseg.engine.config, syncseg.engine.registry, syncseg.model.registry
from syncseg.engine.config import choices, load_config

config = load_config("demo.yaml", ["data.dataset=ade20k", "data.label_map=0:ignore", "model.backbone=timm:resnet18d"])
assert config.data.dataset == "ade20k" and "resnet18" in choices("model.backbone")
print(sorted(name for name in sys.modules if name.split(".")[0] in {heavy!r}))
""".format(heavy=(*HEAVY, "numpy"))


def test_the_schema_loads_a_config_without_torch_cv2_or_albumentations():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"  # numpy neither: the registries are plain Python


def test_the_blocker_blocks():
    done = subprocess.run([sys.executable, "-c", BLOCKER + "import syncseg.data.transforms"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "blocked by the test" in done.stderr
