"""Staging: integer columns gathered on the host come back, in order, as int64 views of one device tensor."""

from __future__ import annotations

import torch

from worker.engine.staging import Staging, to_device


def test_columns_come_back_in_order_as_views_of_one_tensor() -> None:
    stage = Staging()
    handles = [stage.add([3, 1, 4]), stage.add([]), stage.add(range(5, 9)), stage.add(iter([-1, 2 ** 40]))]
    columns = stage.send(torch.device("cpu"))
    assert handles == [0, 1, 2, 3]
    assert [c.tolist() for c in columns] == [[3, 1, 4], [], [5, 6, 7, 8], [-1, 2 ** 40]]
    assert all(c.dtype == torch.long and c.untyped_storage().data_ptr() == columns[0].untyped_storage().data_ptr()
               for c in columns)


def test_an_empty_stage_sends_nothing() -> None:
    assert Staging().send(torch.device("cpu")) == []


def test_to_device_keeps_the_values_and_takes_the_dtype() -> None:
    floats, flags = to_device([0.5, 2.0], torch.float32, "cpu"), to_device((True, False), torch.bool, "cpu")
    assert (floats.dtype, floats.tolist()) == (torch.float32, [0.5, 2.0])
    assert (flags.dtype, flags.tolist()) == (torch.bool, [True, False])
    assert to_device([], torch.long, torch.device("cpu")).shape == (0,)
