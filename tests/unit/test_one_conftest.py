"""tests/conftest.py is the only conftest.py: tests import its helpers as `conftest`, and a second
module of that name (a conftest.py in a subfolder without __init__.py) takes its place in
sys.modules for the rest of an xdist worker, failing every later `from conftest import ...`."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_tests_conftest_is_the_only_one():
    assert sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("conftest.py")) == ["conftest.py"]
