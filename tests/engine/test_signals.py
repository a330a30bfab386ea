"""syncseg.engine.signals.StopRequest: the flag, a second signal, the handlers put back."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from syncseg.engine.signals import StopRequest


def test_first_signal_sets_the_flag_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun forwards a second SIGTERM: ignored
        assert stop.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigint_interrupts_but_never_in_the_middle_of_a_save():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        steps = []
        with pytest.raises(KeyboardInterrupt):
            with stop.deferring_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                steps.append("the rest of the save")  # reached only if the interrupt waits for the save's end
        assert steps == ["the rest of the save"]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # outside a save: at once
