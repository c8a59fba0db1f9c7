"""Shared test setup: which backends are under test.

``UNIMP_TEST_BACKENDS`` (comma-separated, default: every registered backend) lists the backends
this run must cover. A listed backend that cannot load FAILS the run; a backend not listed is
skipped with a reason that says so. Nothing is skipped silently.

A test module that needs one framework says so, and imports it at the top as any module does:
every module under ``tests/backends/<name>/`` needs backend ``<name>``, and any other module
declares ``pytestmark = pytest.mark.backend("<name>")``. Such a module is not imported at all
when its backend is not under test (it is reported skipped, with the reason), and fails to
collect, naming the backend, when the backend is under test but cannot load.
"""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

from unimp import registry

_TESTS = pathlib.Path(__file__).resolve().parent


def backends_under_test() -> list[str]:
    raw = os.environ.get("UNIMP_TEST_BACKENDS", "").strip()
    if not raw:
        return registry.list_backends()
    names = [registry.backend_info(n).name for n in raw.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def require_backend(name: str):
    """Returns the backend module, skips (with a reason) when the backend is not under test,
    and fails when it is under test but cannot be loaded."""
    if name not in backends_under_test():
        pytest.skip(
            f"backend {name!r} not in UNIMP_TEST_BACKENDS={os.environ.get('UNIMP_TEST_BACKENDS')!r}",
            allow_module_level=True,
        )
    try:
        return registry.get_backend(name)
    except ImportError as e:  # listed but missing: that is a failure, never a skip
        pytest.fail(f"backend {name!r} is under test but cannot be loaded: {e}", pytrace=False)


BACKENDS = backends_under_test()


def module_backend(path: pathlib.Path) -> str | None:
    """The backend a test module needs: ``tests/backends/<name>/...``, or the name its
    ``pytestmark = pytest.mark.backend("<name>")`` gives (read from the source, unimported)."""
    rel = path.resolve().relative_to(_TESTS).parts
    if len(rel) > 2 and rel[0] == "backends":
        return rel[1]
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and [ast.unparse(t) for t in node.targets] == ["pytestmark"]
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "pytest.mark.backend"
        ):
            return registry.backend_info(node.value.args[0].value).name
    return None


class _NotCollected(pytest.File):
    """A test module left unimported: its backend is not under test, or cannot load."""

    def __init__(self, *, why: str, fail: bool, **kwargs):
        super().__init__(**kwargs)
        self.why, self.fail = why, fail

    def collect(self):
        if self.fail:
            raise self.CollectError(self.why)
        raise pytest.skip.Exception(self.why, allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    name = module_backend(module_path)
    if name is None:
        return None
    if name not in BACKENDS:
        why = f"{module_path.relative_to(_TESTS)}: backend {name!r} not in UNIMP_TEST_BACKENDS={os.environ.get('UNIMP_TEST_BACKENDS')!r}"
        return _NotCollected.from_parent(parent, path=module_path, why=why, fail=False)
    try:
        registry.get_backend(name)
    except ImportError as e:  # listed but missing: that is a failure, never a skip
        why = f"backend {name!r} is under test but cannot be loaded: {e}"
        return _NotCollected.from_parent(parent, path=module_path, why=why, fail=True)
    return None


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The name of each backend under test, in the test id."""
    require_backend(request.param)
    return request.param


def edited_state_dict(loss_scale, /, **changes):
    """``unimp.state_dict(loss_scale)`` with keys replaced or (value ``KeyError``) deleted; a
    path like ``state__counter`` reaches into nested dicts. For corrupt-state_dict tests."""
    from unimp import state_dict

    d = state_dict(loss_scale)
    for path, value in changes.items():
        where = d
        *head, last = path.split("__")
        for h in head:
            where = where[h]
        if value is KeyError:
            del where[last]
        else:
            where[last] = value
    return d


def step_raw(**changes):
    """The raw device values of one :class:`unimp.StepResult` (NumPy scalars), with ``changes``."""
    import numpy as np

    raw = dict(
        loss=np.float32(0.5),
        scale=np.float32(1024),
        applied=np.bool_(True),
        loss_finite=np.bool_(True),
        grads_finite=np.bool_(True),
        grad_norm=None,
        consecutive_skips=np.int32(0),
        total_skips=np.int32(2),
    )
    raw.update(changes)
    return raw
