"""The forward context: one step's at a time, never nested silently, gone when the step ends."""

from __future__ import annotations

import pytest

from kiln.model.forward_context import ForwardContext, get_forward_context, set_forward_context
from tests.compile.tiny import prefill_metadata


def test_a_second_context_inside_a_step_is_refused_and_the_first_survives() -> None:
    step, other = ForwardContext(prefill_metadata(3), []), ForwardContext(prefill_metadata(5), [])
    with set_forward_context(step):
        with pytest.raises(RuntimeError, match="steps do not nest"), set_forward_context(other):
            pass
        assert get_forward_context() is step
        with set_forward_context(step):  # the active context again: a no-op, it stays active after
            assert get_forward_context() is step
        assert get_forward_context() is step
    with pytest.raises(RuntimeError, match="outside set_forward_context"):
        get_forward_context()
