import warnings

import pytest
import torch

import ort_dynamo


@pytest.fixture(autouse=True)
def fresh_backend():
    """Every test starts with an empty report and no compiled graphs."""
    ort_dynamo.reset()
    torch.manual_seed(0)
    yield
    ort_dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


warnings.filterwarnings("ignore", message=".*TypedStorage.*")
