"""Fixtures shared by the training-stage tests."""

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each fit() builds its own Accelerator; accelerate keeps process-wide singletons between them."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
