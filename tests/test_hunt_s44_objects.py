"""What the watch reads of an object of the user's class (hot/reads.object_tensors): its own tensors, and the
mappings it keeps them in; the batch entering a model is read so, other calls' arguments are not."""

from __future__ import annotations

import torch
from contract.hunt_s44b import Boxes, GraphData, Instances

from nan_magic.hot.kept.call_records import argument_tensors
from nan_magic.hot.reads import iter_tensors


def test_an_objects_mapping_of_fields_is_read_with_the_objects_inside_it() -> None:
    boxes, scores = torch.ones(2, 4), torch.ones(2)
    result = Instances((8, 8), pred_boxes=Boxes(boxes), scores=scores)
    result.history = [torch.ones(1)]  # a list attribute (a cache's layers): not walked
    found = iter_tensors(result, "output", attributes=True)
    assert [path for path, _ in found] == ["output._fields['pred_boxes'].tensor", "output._fields['scores']"]
    assert found[0][1] is boxes and found[1][1] is scores
    assert iter_tensors(result, "input") == []  # another call's arguments: no attributes read


def test_the_batch_entering_a_model_reads_a_graph_objects_store() -> None:
    x, edges, batch = torch.randn(3, 2), torch.zeros(2, 2, dtype=torch.long), torch.zeros(3)
    data = GraphData(x, edges, batch)
    entering = argument_tensors((data,), "input", attributes=True)
    assert [(path, argument) for path, argument, _ in entering] == [
        ("input[0]._store['x']", 0), ("input[0]._store['batch']", 0)]
    assert entering[0][2] is x
    assert argument_tensors((data,), "input") == []


def test_a_numpy_batch_is_read_over_its_own_memory_and_odd_arrays_are_left_unread() -> None:
    import warnings

    import numpy as np

    from nan_magic.hot.kept.call_records import array_values

    table = np.arange(12.0).reshape(3, 4)
    frozen = table.copy()
    frozen.flags.writeable = False
    arguments = (table, {"features": table.astype(np.float32)}, table[::-1], table.astype(">f8"), frozen,
                 np.ones(3, dtype=np.int64), np.zeros((0, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns over a read-only array: never made a tensor
        found = array_values(arguments, "input")
    assert [(path, argument) for path, argument, _ in found] == [("input[0]", 0), ("input[1]['features']", 1)]
    table[0, 0] = np.nan  # the same memory: what the array holds when it is read
    assert bool(found[0][2].isnan()[0, 0])


def test_a_large_mapping_attribute_is_no_store_of_fields() -> None:
    class Batch:
        def __init__(self) -> None:
            self.x = torch.ones(2)
            self.vocab = {f"token{i}": torch.tensor(float(i)) for i in range(1000)}  # read every step: not fields

    assert [path for path, _ in iter_tensors(Batch(), "input[0]", attributes=True)] == ["input[0].x"]


def test_an_object_attribute_is_read_where_it_holds_a_tensor_itself() -> None:
    class Tokenizer:  # no tensor of its own: not walked (its vocabulary neither)
        def __init__(self) -> None:
            self.vocab = {"a": 0}
            self.special = {"pad": torch.tensor(0.0)}

    class Result:
        def __init__(self, boxes: Boxes) -> None:
            self.boxes, self.tokenizer = boxes, Tokenizer()
            self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)

    boxes = torch.ones(2, 4)
    found = iter_tensors(Result(Boxes(boxes)), "output", attributes=True)
    assert [path for path, _ in found] == ["output.boxes.tensor"] and found[0][1] is boxes


def test_a_numpy_batch_is_the_users_again_after_the_step_and_after_the_watch() -> None:
    """The tensors over a numpy batch are held for the step's check only: a buffer the loop resizes in place
    (``refcheck=True``) before the next step, and the last array once the watch is left, are not referenced."""
    import gc
    import weakref

    import numpy as np
    from torch import nn

    import nan_magic

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: np.ndarray) -> torch.Tensor:
            return self.fc(torch.as_tensor(x, dtype=torch.float32)).pow(2).mean()

    for options in ({}, {"defer": True}, {"ops": True}):
        torch.manual_seed(0)
        model = Table()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        buffer = np.zeros((5, 4))
        with nan_magic.watch(model, **options) as watch:
            for step in range(3):
                buffer.resize((5 + step, 4), refcheck=True)  # raises while anything else references its memory
                buffer[:] = 1.0
                opt.zero_grad()
                model(buffer).backward()
                opt.step()
            last = np.ones((2, 4))
            freed = weakref.finalize(last, lambda: None)
            model(last)
            del last
        gc.collect()
        assert not freed.alive, options
        assert watch.report is None


def test_an_objects_reads_are_bounded_whatever_it_accumulates() -> None:
    """A stats log passed into forward whose dict attribute holds a list growing every step, and a 100-entry
    shadow of tensors: the batch's reads stay the same few tensors every step (they were the whole list)."""
    from nan_magic.hot.object_reads import MAX_TENSORS

    class Log:
        def __init__(self) -> None:
            self.stats: dict[str, list[torch.Tensor]] = {"act_mean": []}
            self.scale = torch.ones(1)

    log = Log()
    read = []
    for _step in range(50):
        log.stats["act_mean"].append(torch.ones(1))
        read.append([path for path, _ in iter_tensors(log, "input[1]", attributes=True)])
    assert read[0] == read[-1] == ["input[1].scale"]

    class Shadow:
        def __init__(self) -> None:
            self.weights = {f"w{index}": torch.ones(2) for index in range(40)}
            self.more = {f"m{index}": torch.ones(2) for index in range(40)}

    entering = argument_tensors(([Shadow(), Shadow()],), "input", attributes=True)
    assert len(entering) == MAX_TENSORS  # (80 a shadow, 160 in the list: the first of one call's reads only)
