"""hunt_s44b, objects that keep their tensors in a mapping, entering or leaving a model, in every mode.

Two libraries' classes, as they hold their tensors (no library imported: the same layout, written here): a graph
library's ``Data`` batch (PyTorch Geometric's keeps its tensors in a storage mapping, ``_store``, that ``data.x``
reads through ``__getattr__``), whose features hold a NaN (the watch read no tensor of it: the root's own code was
named the producer, phase forward, cause unclassified); and a detector's result, detectron2's ``Instances`` (its
fields in a dict ``_fields``, a box field an object holding ``.tensor``), whose box regression takes ``log(0)`` (the
watch read no output: the loss code's inf was called bad input data, module None), or whose result object holds
its boxes as an object attribute (the same; ops=True named the log). Already right, kept as evidence: a
batch of a ``torch.Tensor`` subclass whose ops return plain tensors (as torchvision's ``tv_tensors.Image``), with a
NaN pixel (data) or a flat image a per-image std divides (the model's own line). Each with a healthy twin.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_map

from contract import Case, Expect, Scenario
from contract.hunt_s44 import GraphNet
from contract.loops import batches as _batches
from contract.loops import sgd_loop


# ---------------------------------------------------------------- a graph batch keeping its tensors in a store
class Storage(MutableMapping):
    """A mapping over ``_mapping`` whose keys read as attributes, with a weak reference to its owner."""

    def __init__(self, owner: object, **values: Any) -> None:
        self.__dict__["_mapping"] = dict(values)
        self.__dict__["_parent"] = weakref.ref(owner)

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["_mapping"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __getitem__(self, key: str) -> Any:
        return self._mapping[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._mapping[key] = value

    def __delitem__(self, key: str) -> None:
        del self._mapping[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)

    def __len__(self) -> int:
        return len(self._mapping)


class GraphData:
    """A graph batch whose tensors live in ``_store``; ``data.x`` reads them through ``__getattr__``."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> None:
        self.__dict__["_store"] = Storage(self, x=x, edge_index=edge_index, batch=batch)

    def __getattr__(self, key: str) -> Any:
        return getattr(self.__dict__["_store"], key)


def _stored_graph(nan_feature: bool, keyword: bool = False) -> Scenario:
    """Two graphs of 3 nodes a batch, given by position or as ``model(data=...)``; at step 2 node 3's feature 1 is NaN
    (a missing value). Twin: none missing."""
    torch.manual_seed(0)
    model = GraphNet(1.0)
    graphs = []
    for step in range(4):
        x = torch.randn(6, 4)
        if nan_feature and step == 2:
            x[3, 1] = float("nan")
        edges = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 4], [1, 2, 0, 4, 5, 3, 0, 3]])
        graphs.append(GraphData(x, edges, torch.tensor([0, 0, 0, 1, 1, 1])))
    ys = _batches(2, 1)
    if keyword:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def run() -> list[torch.Tensor]:
            losses = []
            for step in range(4):
                loss = F.mse_loss(model(data=graphs[step]), ys[step])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            return losses

        return Scenario((model, opt), run)
    return sgd_loop(model, lambda step: (graphs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a detector's result keeping its fields in a dict
class Boxes:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Instances:
    """A detector's result: the image size and a dict of fields, read as attributes."""

    def __init__(self, image_size: tuple[int, int], **fields: Any) -> None:
        self._image_size = image_size
        self._fields = dict(fields)

    def __getattr__(self, name: str) -> Any:
        if name == "_fields":
            raise AttributeError(name)
        return self._fields[name]


class BoxRegressor(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps, self.box, self.cls = eps, nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Instances:
        raw = self.box(x)
        boxes = torch.cat([raw[:, :2], torch.log(raw[:, 2:].abs() + self.eps)], -1)  # producer: log size
        return Instances((8, 8), pred_boxes=Boxes(boxes), scores=self.cls(x).softmax(-1))


def _instances(eps: float) -> Scenario:
    """The box layer's bias is 0 and step 2's batch holds a blank sample: its sizes are 0, ``log(0)``. Twin: eps."""
    torch.manual_seed(0)
    model = BoxRegressor(eps)
    with torch.no_grad():
        model.box.bias.zero_()
    xs, ys = _batches(3, 4), _batches(3, 4)
    xs[2][1] = 0.0

    def loss_fn(out: Instances, step: int) -> torch.Tensor:
        return F.smooth_l1_loss(out.pred_boxes.tensor, ys[step]) + out.scores.max(-1).values.mean()

    return sgd_loop(model, lambda step: (xs[step],), loss_fn, lr=0.0)


# ---------------------------------------------------------------- a result object holding another object
class Detections:
    """A result whose boxes are an object of their own (``Boxes``, holding ``.tensor``), as an attribute."""

    def __init__(self, boxes: Boxes, scores: torch.Tensor) -> None:
        self.boxes, self.scores = boxes, scores


class NestedRegressor(BoxRegressor):
    def forward(self, x: torch.Tensor) -> Detections:  # type: ignore[override]
        raw = self.box(x)
        return Detections(Boxes(torch.log(raw.abs() + self.eps)), self.cls(x))  # producer: nested log size


def _nested(eps: float) -> Scenario:
    """As :func:`_instances`, the result ``Detections(Boxes(...), scores)``. Twin: eps."""
    torch.manual_seed(0)
    model = NestedRegressor(eps)
    with torch.no_grad():
        model.box.bias.zero_()
    xs, ys = _batches(3, 4), _batches(3, 4)
    xs[2][1] = 0.0

    def loss_fn(out: Detections, step: int) -> torch.Tensor:
        return F.smooth_l1_loss(out.boxes.tensor, ys[step]) + out.scores.mean()

    return sgd_loop(model, lambda step: (xs[step],), loss_fn, lr=0.0)


# ---------------------------------------------------------------- a batch of a Tensor subclass
class Image(torch.Tensor):
    """A tensor subclass whose ops return plain tensors, as torchvision's ``tv_tensors`` do."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Image:
        return torch.Tensor._make_subclass(cls, data, False)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return tree_map(lambda t: t.as_subclass(torch.Tensor) if isinstance(t, Image) else t, out)


class StdNormalised(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps, self.conv, self.head = eps, nn.Conv2d(1, 2, 3), nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        h = h / (h.std(dim=(2, 3), keepdim=True) + self.eps)  # producer: per-image std
        return self.head(h.mean((2, 3)))


def _images(eps: float, nan: bool, flat: bool) -> Scenario:
    """Step 2's batch holds a NaN pixel, or a flat image (the conv has no bias after zeroing it: its map is constant,
    the std 0). Twin: healthy images and an eps."""
    torch.manual_seed(0)
    model = StdNormalised(eps)
    with torch.no_grad():
        model.conv.bias.zero_()
    xs = [torch.randn(2, 1, 5, 5) for _ in range(4)]
    if nan:
        xs[2][1, 0, 2, 2] = float("nan")
    if flat:
        xs[2][1] = 0.5
    images, ys = [Image(x) for x in xs], _batches(2, 1)
    return sgd_loop(model, lambda step: (images[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


CASES = [
    Case("hunt_s44_graph_batch_with_a_store_nan_feature_is_data", lambda: _stored_graph(True),
         Expect("data", "", "GraphNet", step=2, op=None, kinds=frozenset({"nan"}), cause="bad-input-data",
                says=(("default", "skip-batch cannot leave out"), ("defer", "skip-batch cannot leave out")))),
    Case("hunt_s44_graph_batch_with_a_store_by_keyword_nan_feature_is_data", lambda: _stored_graph(True, True),
         Expect("data", "", "GraphNet", step=2, op=None, kinds=frozenset({"nan"}), cause="bad-input-data")),
    Case("hunt_s44_graph_batch_with_a_store_healthy", lambda: _stored_graph(False), None),
    Case("hunt_s44_graph_batch_with_a_store_by_keyword_healthy", lambda: _stored_graph(False, True), None),
    Case("hunt_s44_instances_result_log_of_a_zero_size", lambda: _instances(0.0),
         Expect("forward", "", "BoxRegressor", step=2, op="aten.log.default", marker="log size",
                kinds=frozenset({"-inf"}))),
    Case("hunt_s44_instances_result_healthy", lambda: _instances(1e-6), None),
    Case("hunt_s44_result_object_holding_a_boxes_object_log_of_a_zero_size", lambda: _nested(0.0),
         Expect("forward", "", "NestedRegressor", step=2, op="aten.log.default", marker="nested log size",
                kinds=frozenset({"-inf"}))),
    Case("hunt_s44_result_object_holding_a_boxes_object_healthy", lambda: _nested(1e-6), None),
    Case("hunt_s44_tensor_subclass_batch_nan_pixel_is_data", lambda: _images(1e-5, True, False),
         Expect("data", "", "StdNormalised", step=2, op=None, kinds=frozenset({"nan"}), cause="bad-input-data")),
    Case("hunt_s44_tensor_subclass_batch_flat_image_std_0", lambda: _images(0.0, False, True),
         Expect("forward", "", "StdNormalised", step=2, op="aten.div.Tensor", marker="per-image std")),
    Case("hunt_s44_tensor_subclass_batch_healthy", lambda: _images(1e-5, False, False), None),
]
