import os
import sys

# Spawned ranks import test jobs by module name ("jobs"), so this folder must be on
# sys.path before they start; spawn copies the parent's sys.path.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

# Test tiers (docs/USAGE.md): `make check` runs what is not marked slow or browser in a few
# minutes; `make test` runs everything. Each module states its tier at its top,
# `pytestmark = pytest.mark.quick`, `.slow` or `.browser` (tests/test_suite_hygiene.py
# checks that every one does): whole modules that start many rank processes, torchrun
# jobs, failure injection or a book build are slow. In a quick module the slow tests
# carry `@pytest.mark.slow` themselves: a checkpoint round trip, torchrun, a GPT's
# allocation trace (figures.recorded_trace, tens of seconds). The one rule kept here:
# every multi-rank test at world size 3 or 4 is slow (world size 2 stays quick).


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("browser") is None and params.get("world_size", 2) > 2:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _exercise_ranks():
    """Exercise checks share one pool of ranks per world size for the whole session
    (``exercises.reusing_ranks``; a module that opens its own shares this one)."""
    from zerolearn import exercises

    with exercises.reusing_ranks():
        yield


@pytest.fixture(scope="session", autouse=True)
def _persistent_ranks():
    """The ranks jobs.on_ranks keeps for the session are stopped at its end."""
    import jobs

    yield
    jobs.close_pools()
