"""What the tests share: scenario builders, oracles, child-process helpers and the suite's pytest plugins.

Test modules import these and never one another. ``tests/`` is on ``sys.path`` (pyproject.toml's
``pythonpath``), so every test imports them the same way, ``from helpers.<module> import ...``,
whatever its folder, with or without the conftest (``--noconftest``, as scripts/gpu_check.sh runs).
"""

import pkgutil

import pytest

# The submodules are registered before any is imported, so that their asserts report values as a
# test's do (pytest rewrites only test modules and conftest.py on its own).
pytest.register_assert_rewrite(*(f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)))
