import pytest


@pytest.fixture(autouse=True)
def _notices_said_afresh():
    # A notice is said once per process; each test reads its own.
    from hyper_adaptor import notice

    notice.forget()
    yield


def pytest_collection_modifyitems(config, items):
    """Under ``pytest-xdist --dist loadgroup`` (``make test`` runs tests/distributed, tests/e2e and tests/gpu
    so, on two workers): the tests of one file stay on one worker, so a module-scoped fixture (a launched
    world or training run several tests read) is built once, and so do the files that read the session's
    shared TP2 x PP2 run (tests/e2e/conftest.py), so that run is launched once."""
    for item in items:
        group = "tp2_pp2_run" if "tp2_pp2_run" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
