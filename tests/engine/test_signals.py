"""syncseg.engine.signals.StopRequest: the flag, a second signal, the handlers put back."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from syncseg.engine.signals import StopRequest, Stopped, until_stop


def test_first_signal_sets_the_flag_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun forwards a second SIGTERM: ignored
        assert stop.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_ctrl_c_keeps_the_stop_the_first_signal_asked_for():
    # every loop answers the first within a batch and saves; raising here would abandon that save
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGTERM and stop.requested and stop.agreed()


def test_until_stop_asks_before_every_item_and_stops_when_told():
    answers = iter([False, False, True])
    taken = []
    with pytest.raises(Stopped):
        for item in until_stop(["a", "b", "c", "d"], lambda: next(answers)):
            taken.append(item)
    assert taken == ["a", "b"]
    assert list(until_stop(["a", "b"], None)) == ["a", "b"]
