import os
import sys

# Spawned ranks import test jobs by module name ("jobs"), so this folder must be on
# sys.path before they start; spawn copies the parent's sys.path.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

# Test tiers (docs/USAGE.md): `make check` runs what is not marked slow or browser in a few
# minutes; `make test` runs everything. Whole modules that start many rank processes,
# torchrun jobs, failure injection or a book build are slow; so is every multi-rank
# test at world size 3 or 4 (world size 2 stays in the quick tier), every checkpoint
# round trip, and every test that records a GPT's allocation trace
# (figures.recorded_trace, tens of seconds). Tests with no world_size parameter carry
# the mark themselves, or are named in SLOW_TESTS.
SLOW_MODULES = {"test_checkpoint", "test_failures", "test_cli", "test_residual", "test_simulated_world",
                "test_deepspeed_cpu", "test_seed_experiment", "test_trust_checkpoints"}
SLOW_TESTS = {"test_equivalence::test_clipping_on_shards_matches_clip_grad_norm",  # 3 ranks
              "test_equivalence::test_checkpoint_round_trip_continues_exactly",
              "test_launch::test_input_only_the_workers_can_refuse_exits_2_too",  # torchrun
              "test_launch::test_a_master_port_another_program_holds_is_named_and_does_not_hang",  # torchrun
              "test_widgets::test_fragmentation_simulator_replays_through_defrag",  # recorded_trace
              "test_widgets::test_fragmentation_default_fails_with_a_third_free_until_md_is_on"}
BROWSER_MODULES = {"test_browser"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
        params = getattr(getattr(item, "callspec", None), "params", {})
        if module in BROWSER_MODULES:
            item.add_marker(pytest.mark.browser)
        elif (module in SLOW_MODULES or f"{module}::{getattr(item, 'originalname', item.name)}" in SLOW_TESTS
              or params.get("world_size", 2) > 2):
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
