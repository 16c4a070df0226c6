import pytest


@pytest.fixture(autouse=True)
def _notices_said_afresh():
    # A notice is said once per process; each test reads its own.
    from hyper_adaptor import notice

    notice.forget()
    yield

