"""What a watch could leave behind in the process and in the user's objects, dumped to compare (test_no_trace_s43).

:func:`global_state` is what belongs to the process (hooks registries, flags, patched attributes, stacks, filters,
loggers, trace functions, dynamo's stance, counters and config); :func:`object_state` is what belongs to the user's
model, optimizer, scheduler and scaler (hooks, ``requires_grad``, gradients, versions, states) and the RNGs. Both are
plain values compared with ``==`` (tensors as lists, NaN as a string), so a failing test prints the difference.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import signal
import sys
import threading
import warnings
from typing import Any

import numpy
import torch
import torch.utils.checkpoint
import torch.utils.data.dataloader
from torch import nn
from torch.nn.modules import module as module_registry
from torch.optim import optimizer as optimizer_registry

#: Where a patch of ours lives, or a user's program reads from: each attribute's identity is compared.
PATCHABLE: tuple[Any, ...] = (
    torch, torch.Tensor, torch.autograd, torch.autograd.graph, torch.autograd.graph.saved_tensors_hooks,
    torch.autograd.grad_mode.inference_mode, torch.nn.Module, torch.nn.functional, module_registry,
    torch.optim.Optimizer, torch.optim.Adam, torch.optim.SGD, torch.optim.lr_scheduler.LRScheduler,
    torch.amp.GradScaler, torch.utils.checkpoint, torch.utils.checkpoint.CheckpointFunction,
    torch.utils.data.dataloader._BaseDataLoaderIter, torch.utils._python_dispatch.TorchDispatchMode,
    torch.overrides.TorchFunctionMode, torch.jit, torch.func, torch.serialization, torch.utils,
    torch.nn.utils.stateless, optimizer_registry, sys, warnings, logging,
)

_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                 "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks_with_kwargs")
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")


def plain(value: Any) -> Any:
    """``value`` as comparable plain data: tensors as (dtype, shape, values with NaN spelled), containers walked."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().double().flatten().tolist()
        return (str(value.dtype), tuple(value.shape), [repr(x) if math.isnan(x) else x for x in flat])
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def _hooks(owner: Any, names: tuple[str, ...]) -> dict[str, list[int]]:
    return {name: [id(hook) for hook in getattr(owner, name, {}).values()] for name in names
            if hasattr(owner, name)}


def global_state() -> dict[str, Any]:
    """The process's state a watch touches or could touch."""
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters
    state: dict[str, Any] = {
        "global module hooks": {name: list(value) for name, value in vars(module_registry).items()
                                if name.startswith("_global_") and isinstance(value, dict)},
        "global optimizer hooks": {name: list(value) for name, value in vars(optimizer_registry).items()
                                   if name.startswith("_global_") and isinstance(value, dict)},
        "grad enabled": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "default dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "dispatch stack": torch._C._len_torch_dispatch_stack(),
        "function stack": torch._C._len_torch_function_stack(),
        "saved tensors hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "patched": {f"{getattr(owner, '__name__', owner)}.{name}": id(value)
                    for owner in PATCHABLE for name, value in list(vars(owner).items())
                    if not name.startswith("__") or name in ("__init__", "__enter__", "__exit__", "__call__",
                                                              "__reduce_ex__", "__next__")},
        "warnings filters": list(warnings.filters),
        "loggers": {name: (logger.level, len(logger.handlers), logger.disabled, logger.propagate)
                    for name, logger in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]
                    if isinstance(logger, logging.Logger)},
        "logging disabled": logging.root.manager.disable,
        "trace": (sys.gettrace(), sys.getprofile(), threading.gettrace(), threading.getprofile()),
        "hooks of the interpreter": (sys.excepthook, sys.displayhook, sys.unraisablehook, threading.excepthook),
        "sigint": signal.getsignal(signal.SIGINT),
        "recursion limit": sys.getrecursionlimit(),
        "stance": eval_frame._stance,
        "dynamo counters": {key: dict(value) for key, value in counters.items() if value},
        "dynamo config": repr(sorted(torch._dynamo.config.get_config_copy().items())),
        "autocast dtype": torch.get_autocast_dtype("cpu"), "autocast cache": torch.is_autocast_cache_enabled(),
        "torch function": torch._C._is_torch_function_enabled(),
        "functorch": torch._C._functorch.peek_interpreter_stack() is None,
        "forward ad": torch.autograd.forward_ad._current_level,
        "backends": (torch.backends.cudnn.enabled, torch.backends.cudnn.deterministic,
                     torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled,
                     torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "print options": dict(vars(torch._tensor_str.PRINT_OPTS)), "numpy print": numpy.get_printoptions(),
        "gc": (gc.isenabled(), gc.get_threshold(), list(gc.callbacks)),
        "threads alive": sorted(thread.name for thread in threading.enumerate()),
        "environment": dict(os.environ),
        "import system": (list(sys.path), list(sys.meta_path), list(sys.path_hooks)),
        "showwarning": (warnings.showwarning, warnings.formatwarning),
        "switch interval": sys.getswitchinterval(),
    }
    return state


def object_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                 identities: bool = True) -> dict[str, Any]:
    """The user's objects' state, and the generators' next draws (drawn from copies: the generators move not).

    ``identities``: with the ids of the hooks (compared within one run; a twin run's objects have others)."""
    state: dict[str, Any] = {
        "module hooks": {name: {hooks: len(ids) for hooks, ids in _hooks(module, _MODULE_HOOKS).items()}
                         for name, module in model.named_modules()},
        "parameters": {name: {"requires_grad": p.requires_grad, "version": p._version, "value": plain(p),
                              "grad": plain(p.grad) if p.grad is not None else None,
                              "accumulate hooks": len(p._post_accumulate_grad_hooks or {}),
                              "tensor hooks": len(p._backward_hooks or {})}
                       for name, p in model.named_parameters()},
        "buffers": {name: plain(b) for name, b in model.named_buffers()},
        "training": [m.training for m in model.modules()],
        "optimizer": plain(optimizer.state_dict()),
        "optimizer hooks": {name: len(ids) for name, ids in _hooks(optimizer, _OPTIMIZER_HOOKS).items()},
        "scheduler": plain({k: v for k, v in scheduler.state_dict().items()}),
        "scaler": plain(scaler.state_dict()) if scaler is not None else None,
        "rng": plain(torch.get_rng_state()),
        "next draws": (_next_torch_draw(), random.getstate(), numpy.random.get_state()[1].tolist()),
    }
    state["attributes"] = {f"{kind} {name}": sorted(vars(owner)) for kind, objects in (
        ("module", list(model.named_modules())), ("parameter", list(model.named_parameters())),
        ("object", [("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)]))
        for name, owner in objects}
    state["param groups"] = [sorted(group) for group in optimizer.param_groups]
    if identities:
        state["module hook ids"] = {name: _hooks(module, _MODULE_HOOKS) for name, module in model.named_modules()}
    return state


def _next_torch_draw() -> float:
    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    return float(torch.rand(1, generator=generator))


def differences(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The entries that differ, with their two values (a patched attribute: by name)."""
    found: dict[str, tuple[Any, Any]] = {}
    for key in before.keys() | after.keys():
        first, second = before.get(key), after.get(key)
        if key == "patched":
            changed = {name: (first.get(name), second.get(name)) for name in first.keys() | second.keys()
                       if first.get(name) != second.get(name)  # (an attribute added and left counts too)
                       and not name.startswith("sys.last_")}  # (the shell's record of a cell's error, for %debug)
            if changed:
                found[key] = (sorted(changed), None)
        elif key == "loggers":  # (torch makes its loggers as its modules are first imported: ours would count)
            changed = {name: (first.get(name), level) for name, level in second.items()
                       if (name in first or name.startswith("nan_magic")) and first.get(name) != level}
            if changed:
                found[key] = (changed, None)
        elif first != second:
            found[key] = (first, second)
    return found
