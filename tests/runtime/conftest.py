import gc

import pytest


@pytest.fixture
def no_asyncio_errors(caplog):
    """Fail on 'Task was destroyed but it is pending' or 'exception was never retrieved'."""
    yield
    gc.collect()
    records = [*caplog.get_records("call"), *caplog.get_records("teardown")]
    errors = [r.getMessage() for r in records if r.name == "asyncio"]
    assert not errors
