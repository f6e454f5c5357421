"""Launching a Triton kernel through its compiled binary once warm: the host cost of an op call near the floor.

`kernel[grid](*args, **constexprs)` costs tens of microseconds of Python on every call, even when nothing needs
compiling: Triton binds and specialises every argument (~0.6 µs each through its native code), builds a cache key
string, looks the kernel up, and, for an autotuned kernel, first rebuilds the autotuning key from every argument
(~100 µs measured on an H100 host). A prefill step of a 48-layer model makes a few hundred such calls.

`Launcher` keeps, per specialisation, the `CompiledKernel` that the first call produced (and, for an autotuned
kernel, the config it chose), and afterwards calls its launcher directly (triton-lang/triton #6064: "cache the
compiled kernel and call it directly"). What decides the specialisation is computed here, cheaply, from the
arguments: each tensor's dtype and 16-byte alignment, each integer's divisibility by 16, equality to 1 and width,
the constexpr keywords, the autotuning key's values and the device. A call whose key is new goes through Triton's
own path, which compiles (and tunes) exactly as before. Under the interpreter (`TRITON_INTERPRET=1`) every call
takes Triton's own path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from triton import knobs
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

Grid = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]

_I32 = 2**31


def _arg_key(arg: Any) -> Any:
    """What Triton specialises a runtime argument on (an over-approximation is safe: it only compiles more).

    An int: equal to 1, divisible by 16, wider than 32 bits. A tensor: its dtype and 16-byte alignment. A float:
    nothing. Anything else (None, a bool, a string): its value.
    """
    if type(arg) is int:
        code = 1 if arg == 1 else 16 if arg & 15 == 0 else 0
        return code if -_I32 <= arg < _I32 else code + 64
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15 == 0)
    return float if type(arg) is float else arg


class Launcher:
    """A `@triton.jit` kernel, optionally under `@triton.autotune`, called as `launcher(grid, *args, **constexprs)`.

    Runtime arguments are positional, in the kernel's order; constexprs and launch options (`num_warps`, ...) are
    keywords. `grid` is a tuple or, as with Triton, a function of the launch's metadata (the constexpr keywords and
    the chosen config), evaluated on every call.
    """

    def __init__(self, kernel: JITFunction | Autotuner) -> None:
        self.kernel = kernel
        self.autotuner = kernel if isinstance(kernel, Autotuner) else None
        self.jit = kernel.fn if self.autotuner is not None else kernel
        self.compiled = isinstance(self.jit, JITFunction)  # False under the interpreter
        names = list(self.jit.arg_names)
        # The autotuning key's arguments given positionally: their values choose the config, so they key the cache.
        keys = self.autotuner.keys if self.autotuner is not None else []
        self._tuned_positions = tuple(names.index(k) for k in keys if k in names)
        self._names = names
        self._cache: dict[tuple, tuple[Any, tuple, dict[str, Any]]] = {}

    def __call__(self, grid: Grid, *args: Any, **kwargs: Any) -> None:
        if not self.compiled:
            self.kernel[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        key = (
            device,
            tuple(map(_arg_key, args)),
            tuple(kwargs.items()),
            tuple(args[i] for i in self._tuned_positions if i < len(args)),
        )
        entry = self._cache.get(key)
        if entry is None:
            self._first_call(key, grid, args, kwargs)
            return
        compiled, tail, meta = entry
        g = grid(meta) if callable(grid) else grid
        stream = driver.active.get_current_stream(device)
        enter = knobs.runtime.launch_enter_hook
        full = args + tail
        metadata = compiled.launch_metadata(g, stream, *full) if enter is not None else None
        compiled.run(
            g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, compiled.function,
            compiled.packed_metadata, metadata, enter, knobs.runtime.launch_exit_hook, *full,
        )  # fmt: skip

    def _first_call(self, key: tuple, grid: Grid, args: tuple, kwargs: dict[str, Any]) -> None:
        """Triton's own path (compile, tune); then remember the binary, the constexpr tail and the grid's meta."""
        compiled = self.kernel[grid](*args, **kwargs)
        chosen = dict(self.autotuner.best_config.all_kwargs()) if self.autotuner is not None else {}
        values = {**kwargs, **chosen}
        tail = []
        for name, param in zip(self._names[len(args) :], self.jit.params[len(args) :], strict=True):
            if name in values:
                tail.append(values[name])
            elif param.default is not inspect.Parameter.empty:
                tail.append(param.default)
            else:
                return  # a runtime argument given by keyword: keep Triton's path for this key
        if compiled is not None:
            self._cache[key] = (compiled, tuple(tail), values)


_launchers: dict[int, Launcher] = {}


def launch_kernel(kernel: JITFunction | Autotuner, grid: Grid, *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, through a `Launcher` kept for `kernel` (made on its first launch)."""
    launcher = _launchers.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _launchers[id(kernel)] = Launcher(kernel)
    launcher(grid, *args, **kwargs)
