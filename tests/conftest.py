import os

import pytest
import torch
from hypothesis import settings

# Deterministic by default so CI never flakes; HYPOTHESIS_PROFILE=dev explores new examples.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=25)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
