"""The environment-variable table (unimp.environment.VARIABLES, the docs' generated table)
names every variable the library's code reads or sets, and nothing it does not."""

from __future__ import annotations

import pathlib
import re

from unimp.environment import VARIABLES

ROOT = pathlib.Path(__file__).resolve().parent.parent / "unimp"
# os.environ["X"], os.environ.get("X"), .setdefault("X", ...), {**os.environ, "X": ...}, and
# a module constant NAME_ENV = "X"
_USES = re.compile(
    r'environ(?:\.get|\.setdefault)?[\[(]\s*"([A-Z][A-Z0-9_]+)"'
    r'|\*\*os\.environ,\s*"([A-Z][A-Z0-9_]+)"'
    r'|^[A-Z_]*ENV\s*=\s*"([A-Z][A-Z0-9_]+)"',
    re.M,
)


def _named() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for m in _USES.finditer(path.read_text(encoding="utf-8")):
            name = next(g for g in m.groups() if g)
            found.setdefault(name, []).append(str(path.relative_to(ROOT.parent)))
    return found


def test_every_variable_the_code_names_is_in_the_table_and_no_other():
    named = _named()
    assert {"UNIMP_FP8_NATIVE", "KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL"} <= set(named)  # the scan sees them
    missing = {n: where for n, where in named.items() if n not in VARIABLES}
    assert not missing, f"add these to unimp.environment.VARIABLES: {missing}"
    unused = set(VARIABLES) - set(named)
    assert not unused, f"unimp.environment.VARIABLES names variables no code reads: {unused}"
    for name, v in VARIABLES.items():
        assert v.used_by and v.values and v.effect, name
