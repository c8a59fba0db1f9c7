"""Regenerates the command outputs the documentation site shows (docs/outputs/), from real runs.

    python scripts/docs_outputs.py            # every output (about two minutes on 2 CPU cores)
    python scripts/docs_outputs.py doctor     # only some: compare, trace, doctor

The site includes these files (pymdownx.snippets) and does not run the commands while building:
``unimp compare`` trains in three frameworks, too long for every build. Run this after a change
to what the commands print, and commit docs/outputs/ with the change.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "outputs"
UNIMP = [sys.executable, "-m", "unimp.cli"]


def _run(args: list[str]) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "COLUMNS": "100"}
    done = subprocess.run([*UNIMP, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode not in (0, 1):  # doctor exits 1 when it finds a problem
        raise SystemExit(f"unimp {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return f"$ unimp {' '.join(args)}\n{done.stdout.rstrip()}\n"


def compare(tmp: pathlib.Path) -> None:
    """``unimp compare`` with the defaults: the table, and the report's picture."""
    text = _run(["compare", "--out", str(tmp / "report")]).replace(str(tmp / "report"), "unimp-report")
    (OUT / "compare.txt").write_text(text.replace(" --out unimp-report\n", "\n", 1))  # the default
    shutil.copy(tmp / "report" / "report.png", OUT / "compare-report.png")


def trace(tmp: pathlib.Path) -> None:
    """``unimp trace mixed_float16 --model vit --diff``: where the frameworks' dtypes differ (the
    MLP's run in the same dtypes everywhere; the one-block ViT's softmax and LayerNorm do not)."""
    (OUT / "trace-diff.txt").write_text(_run(["trace", "mixed_float16", "--model", "vit", "--diff"]))


def doctor(tmp: pathlib.Path) -> None:
    """``unimp doctor`` on the committed step log of a run whose learning rate rose too fast."""
    log = "tests/data/steplogs/v1_lr_collapse.jsonl"
    (OUT / "doctor.txt").write_text(_run(["doctor", log]))


STEPS = {"compare": compare, "trace": trace, "doctor": doctor}


def main(argv: list[str]) -> None:
    unknown = set(argv) - set(STEPS)
    if unknown:
        raise SystemExit(f"unknown output(s) {sorted(unknown)}; choose from {', '.join(STEPS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in argv or STEPS:
            STEPS[name](pathlib.Path(tmp))
            print("wrote", name)


if __name__ == "__main__":
    main(sys.argv[1:])
