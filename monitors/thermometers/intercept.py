"""Attention logits for attention nobody wrote a probe for (issue 22, item 5).

Finding it, at instrument() time: a module is attention when its forward calls
`F.scaled_dot_product_attention` (nanoGPT's CausalSelfAttention) or Hugging Face's attention
functions (`ALL_ATTENTION_FUNCTIONS`, `eager_attention_forward`: GPT-2, Llama, ...). We read the
names its bytecode uses, following the Python functions and methods it names two levels down, so
a helper that calls SDPA counts, and nothing runs. A module named in `attn_types` may also
compute its own softmax (the eager path). One that does none of these, or a Hugging Face module
whose attention implementation reports nothing (flash_attention_2, flex_attention), is refused
there, by name, with the fix (`AttentionNotProbed`).

Measuring it, on sampled steps only: a forward pre-hook on each found module enters one
TorchFunctionMode, its forward hook (always_call, so an exception cannot leave it on) leaves it.
Inside, under attn_mode "lse" (the default), an SDPA call the fused kernel path takes (no mask,
dropout or GQA: attention.fused_call) runs through the kernel SDPA dispatches to, by its private
aten op, which hands out the rows' log-sum-exp as well: the output and gradient are the call's
own (bit-identical on CPU, autocast's casts repeated) and the figure is a max over [B, H, L]. Any
other SDPA call runs as written and is measured from its own q and k
(attention.sdpa_scores_stats: masks, is_causal and GQA as the call passes them), and every
softmax over the last dim of a >= 3-d tensor from its input, which is the masked logits
(attention.softmax_stats); all are attributed to the innermost found module running. On
unsampled steps the hooks return at once and no mode is on.

Cost while on: every torch call inside the module's forward passes through
`__torch_function__` (a few microseconds each, tens of calls a layer), plus the figure: a max
over the kernel's lse, or one explicit q k^T for the sequences and heads sampled
(bench/thermometer_overhead_any.py).
"""

from __future__ import annotations

import inspect
import types
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from thermowatch.monitors.thermometers.attention import (
    OP_REFUSED,
    AttnProbe,
    attention_entropy,
    fused_attention_with_lse,
    fused_call,
    sdpa_scores_stats,
    softmax_stats,
)
from thermowatch.monitors.thermometers.budget import ATTN, NullTimer, Timer

DOCS = "docs/any-trainer.md#attention-logits"
_SDPA = F.scaled_dot_product_attention
_SOFTMAX = frozenset({F.softmax, torch.softmax, torch.Tensor.softmax})
# Hugging Face routes every attention through these (transformers >= 4.48; the names it calls)
_HF_NAMES = frozenset({"ALL_ATTENTION_FUNCTIONS", "eager_attention_forward", "sdpa_attention_forward"})
_HF_PROBED = (None, "eager", "sdpa")  # implementations whose logits we can see


class AttentionNotProbed(ValueError):
    """An attention module the thermometers cannot read, found at instrument() time."""


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:  # nested functions, comprehensions
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def calls(fn, cls: type | None, depth: int = 2) -> set[str]:
    """What `fn` calls, of what we can measure: a subset of {"sdpa", "softmax", "hf"}, read from
    the names its bytecode uses, following the Python functions (outside torch) and the methods
    of `cls` it names, `depth` levels down."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return set()
    found: set[str] = set()
    scope = getattr(fn, "__globals__", {})
    for name in _code_names(code):
        obj = scope.get(name)
        if name == "scaled_dot_product_attention" or obj is _SDPA:
            found.add("sdpa")
        elif name == "softmax" or any(obj is f for f in _SOFTMAX):
            found.add("softmax")
        elif name in _HF_NAMES:
            found.add("hf")
        if depth == 0:
            continue
        target = obj if isinstance(obj, types.FunctionType) and not obj.__module__.startswith("torch") else None
        if target is None and cls is not None:
            attr = inspect.getattr_static(cls, name, None)
            attr = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            target = attr if isinstance(attr, types.FunctionType) else None
        if target is not None and target is not fn:
            found |= calls(target, cls, depth - 1)
    return found


def find(name: str, mod: nn.Module, named: bool, auto: bool) -> bool:
    """Whether to measure `mod` by interception: True for a module whose forward calls SDPA or
    Hugging Face's attention (and, when `named` in attn_types, its own softmax). Raises
    AttentionNotProbed for one we would have to measure and cannot."""
    if not (named or auto):
        return False
    what = calls(type(mod).forward, type(mod))
    cls = f"{type(mod).__module__}.{type(mod).__qualname__}"
    if "hf" in what:
        impl = getattr(getattr(mod, "config", None), "_attn_implementation", None)
        if impl not in _HF_PROBED:
            raise AttentionNotProbed(
                f"attention module {name!r} ({cls}) runs Hugging Face's attn_implementation={impl!r}, whose "
                "kernel hands out no attention logits: load the model with attn_implementation='sdpa' or "
                "'eager' to measure them, or set ThermometerConfig(attn_find=False"
                + (", attn_types=()" if named else "") + f") to skip them (see {DOCS})"
            )
        return True
    if "sdpa" in what or (named and "softmax" in what):
        return True
    if named:
        raise AttentionNotProbed(
            f"attention module {name!r} ({cls}) is in ThermometerConfig.attn_types but its forward calls "
            "neither F.scaled_dot_product_attention nor a softmax nor Hugging Face's attention functions, and "
            "it has no `thermo_probe`, so its logits cannot be measured: leave its class out of attn_types "
            f"(attn_types=() skips every such module) or implement the thermo_probe protocol (see {DOCS})"
        )
    return False


class Site:
    """One found module: its probe, and what it saw this forward."""

    def __init__(self, name: str, mod: nn.Module, probe: AttnProbe) -> None:
        self.name, self.cls, self.probe = name, type(mod).__qualname__, probe
        self.calls = 0  # SDPA / softmax calls seen in the current sampled forward
        self.warned = False
        self.broken = False  # a figure failed once: warned, the slots stay NaN from then on
        self.fused = True  # "lse": its SDPA calls run through the kernel's lse op, until that op fails once

    def n_seq(self) -> int | None:
        return self.probe.entropy_batch if self.probe.mode in ("sample", "lse") else None

    def on_sdpa(self, args: tuple, kwargs: dict) -> None:
        p = self.probe
        mx, ent = sdpa_scores_stats(args, kwargs, p.heads, self.n_seq(), p.entropy, lse=p.mode == "lse")
        p.put_head_max(mx, p.heads)
        if ent is not None:
            p.put_entropy(ent)

    def on_fused(self, call: tuple, lse) -> None:
        """The figure of a call the fused kernel ran (Interceptor._fused): its lse, free, and on
        entropy steps one more fused pass without gradient over the first entropy_batch sequences."""
        p = self.probe
        p.put_lse(lse.detach())
        if p.entropy:
            q, k, _, scale, is_causal = call
            n = p.entropy_batch
            p.put_entropy(attention_entropy(q[:n].detach(), k[:n].detach(), scale, is_causal))

    def on_softmax(self, args: tuple, kwargs: dict, out) -> None:
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or dim not in (-1, x.dim() - 1):
            return  # not attention weights over keys
        mx, ent = softmax_stats(x.detach(), out.detach(), self.n_seq(), self.probe.entropy,
                                lse=self.probe.mode == "lse")
        self.probe.put_head_max(mx, None)
        if ent is not None:
            self.probe.put_entropy(ent)


class Interceptor(TorchFunctionMode):
    """The one TorchFunctionMode of a Thermometers; on only inside sampled forwards of its sites."""

    def __init__(self, timer: Timer | None = None) -> None:
        super().__init__()
        self.stack: list[Site] = []  # the found modules running, innermost last
        # budget.py: a read forward counts from the pre-hook to the forward hook, less the user's
        # own calls (timed out in __torch_function__): the figure, and the mode's dispatch of every
        # torch call inside the module, which cost as much as the figure on a 4L d128 CPU step.
        self.timer = timer or NullTimer()

    def hooks(self, mod: nn.Module, site: Site) -> list[torch.utils.hooks.RemovableHandle]:
        def pre(m, args):
            if site.probe.mode is None or site.broken:
                return
            site.calls = 0
            self.stack.append(site)
            if len(self.stack) == 1:
                self.timer.start()
                self.__enter__()

        def post(m, args, out):
            if not self.stack or self.stack[-1] is not site:
                return
            self.stack.pop()
            if not self.stack:
                self.__exit__(None, None, None)
                self.timer.stop(ATTN)
            if site.calls == 0 and not site.warned:
                site.warned = True
                warnings.warn(f"thermowatch: attention module {site.name!r} ({site.cls}) ran a sampled forward "
                              "without calling F.scaled_dot_product_attention or a softmax; its attention "
                              f"logits stay NaN (see {DOCS})", stacklevel=2)

        return [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post, always_call=True)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            site = self.stack[-1]
            if site.probe.mode == "lse" and site.fused and not site.broken:
                out = self._fused(site, args, kwargs)
                if out is not None:
                    return out
            self._measure(Site.on_sdpa, args, kwargs)
        self.timer.stop(ATTN)  # the user's own call is not the thermometers' cost
        try:
            out = func(*args, **kwargs)
        finally:  # the forward hook's stop(ATTN) stays paired, even when the call raises
            self.timer.start()
        if func in _SOFTMAX:
            self._measure(Site.on_softmax, args, kwargs, out)
        return out

    def _fused(self, site: Site, args: tuple, kwargs: dict):
        """Run the user's SDPA call through the kernel it dispatches to, by the private op that
        hands out the lse as well (attention.fused_call says which calls): the output and its
        gradient are the call's own, the figure costs a max over [B, H, L]. None: not this call
        (a mask, dropout, GQA, ...), or the op failed (then never again for this site, warned
        once): the caller measures it from q and k and runs the call as written."""
        call = fused_call(args, kwargs)
        if call is None:
            return None
        self.timer.stop(ATTN)  # the attention itself is the user's cost, not the thermometers'
        try:
            out, lse = fused_attention_with_lse(*call)
        except OP_REFUSED as exc:
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            site.fused = False
            warnings.warn(f"thermowatch: torch's fused attention-with-lse op refused {site.name!r} ({site.cls}) "
                          f"({exc!r}); its attention figure now comes from an explicit q k^T of a sample, "
                          "and its SDPA call runs as written", stacklevel=3)
            return None
        finally:
            self.timer.start()
        self._measure(Site.on_fused, call, lse)
        return out

    def _measure(self, method, *a) -> None:
        site = self.stack[-1]
        if site.broken:
            return
        site.calls += 1
        self.timer.start()
        try:
            method(site, *a)
        except Exception as exc:  # a thermometer never stops the training step
            site.broken = True
            warnings.warn(f"thermowatch: attention logits of {site.name!r} ({site.cls}) could not be computed "
                          f"({exc!r}); its slots stay NaN from now on", stacklevel=3)
        finally:
            self.timer.stop(ATTN)
