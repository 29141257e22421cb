"""Layers that read the same input prepare it once, eagerly: q/k/v (and gate/up) share one quantized X.

In a Llama block, ``q_proj``, ``k_proj`` and ``v_proj`` all read the normed hidden state, and
``gate_proj`` and ``up_proj`` both read the second one. Each quantized linear prepares its X for
fprop (along K) and for wgrad (along M, saved packed for backward). Where that preparation is
deterministic - nearest rounding, no random Hadamard signs - it depends only on the tensor's
values and the spec, so the second and third layer can take the first one's result: the same bits,
one quantization pass instead of three, and one saved packed copy (all three layers' autograd
contexts hold the same tensors) instead of three. Under ``torch.compile`` the compiler's
common-subexpression pass merges the layers' ``prepare_x`` calls instead; eagerly, the layers of one
:func:`fp4train.convert` share one :class:`SharedInput` (a memo of that model, not of the process).

The memo holds the results for one input at a time: the root tensor of the view (``x._base``), by
weak reference, at its version counter. A different input, an in-place change of this one, or its
release drops the memo (and the memory it holds). Stochastic rounding and random signs draw a
per-layer seed, so those operands are never shared (their key is None).
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")


class SharedInput:
    """A memo of operands prepared from one input tensor (see the module docstring)."""

    def __init__(self) -> None:
        self._root: weakref.ref | None = None
        self._version = -1
        self._entries: dict = {}

    def get(self, x: torch.Tensor, key: Hashable | None, make: Callable[[], T]) -> T:
        """``make()``, or the result of an earlier call for the same ``key`` on the same values of
        ``x`` (same root tensor, unchanged since, same view). ``key`` None: never shared."""
        if key is None or x.is_inference() or torch.is_inference_mode_enabled():
            return make()  # inference tensors carry no version counter: nothing to check a memo against
        root = x._base if x._base is not None else x
        if self._root is None or self._root() is not root or self._version != root._version:
            self._reset(root)
        k = (key, tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype)
        if k not in self._entries:
            self._entries[k] = make()
        return self._entries[k]

    def __reduce__(self):
        return SharedInput, ()  # a copied or pickled model starts with an empty memo (it holds a weak reference)

    def clear(self) -> None:
        self._root, self._version, self._entries = None, -1, {}

    def _reset(self, root: torch.Tensor) -> None:
        def released(ref, memo=weakref.ref(self)):
            m = memo()
            if m is not None and m._root is ref:
                m.clear()

        self._root, self._version, self._entries = weakref.ref(root, released), root._version, {}
