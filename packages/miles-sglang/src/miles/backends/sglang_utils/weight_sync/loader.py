"""Engine side: copy received tensors into a model's parameters and buffers by Hugging Face name.

Fused MoE expert tensors also load per expert, under their checkpoint names (`expert_layout`):
what a trainer sends and what a checkpoint on disk holds. Validation comes first and covers every tensor, so a bad update changes nothing: an engine never
serves a half-loaded mix of old and new weights because one name in the last bucket was wrong.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from miles.backends.sglang_utils.weight_sync.expert_layout import expert_views

# Problems listed in one error before the rest are only counted: enough to see a pattern.
_MAX_LISTED = 5
# Below this many bytes an update copies on one thread: starting threads would cost more.
_PARALLEL_COPY_BYTES = 8 << 20


class WeightUpdateError(ValueError):
    """A weight update named an unknown tensor, sent a wrong shape or a non-finite value, or left
    out part of a checkpoint; the model is unchanged."""


def load_named_tensors(
    model: torch.nn.Module,
    named_tensors: Iterable[tuple[str, Tensor]],
    *,
    complete: bool = False,
    rename: Callable[[str], str] | None = None,
) -> int:
    """Copy each `(name, tensor)` into the model's parameter or buffer of that name; return the count.

    Tensors are cast to the target's dtype and device. Tied weights (e.g. `lm_head.weight` tied to
    `model.embed_tokens.weight`) are accepted under either name. `rename`: the model's name of a
    name it does not know (a checkpoint's layout, which transformers renamed on load). Raises
    `WeightUpdateError`, before anything is copied, if any name is unknown, any shape differs from
    the model's or any value is not finite; with `complete` (a whole checkpoint), also if a
    parameter is missing.
    """
    named_tensors = list(named_tensors)
    targets = _targets(model)
    views = expert_views(model.named_parameters())
    targets.update({name: view for name, (view, _) in views.items()})
    if rename is not None:
        named_tensors = [(_known(name, targets, rename), t) for name, t in named_tensors]
    problems = [p for name, tensor in named_tensors if (p := _check(name, tensor, targets))]
    refused = len(problems)  # of the tensors sent; missing parameters are counted apart
    missing: list[str] = []
    if complete:
        sent = {name for name, _ in named_tensors}
        loaded = {id(targets[name]) for name in sent if name in targets and name not in views}
        # A fused expert tensor is loaded when every one of its per-expert parts is.
        parts: dict[str, set[str]] = {}
        for part, (_, fused) in views.items():
            parts.setdefault(fused, set()).add(part)
        whole = {fused for fused, names in parts.items() if names <= sent}
        missing = [
            f"parameter {name!r} is missing"
            for name, parameter in model.named_parameters()
            if id(parameter) not in loaded and name not in whole
        ]
    if problems or missing:
        counts = []
        if refused:
            counts.append(f"{refused} of the {len(named_tensors)} tensors sent cannot be loaded")
        if missing:
            counts.append(f"{len(missing)} of the model's parameters were not sent")
        problems += missing
        listed = "; ".join(problems[:_MAX_LISTED])
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise WeightUpdateError(f"{' and '.join(counts)}, so nothing was loaded: {listed}{more}")
    _copy_all([(targets[name], tensor) for name, tensor in named_tensors])
    return len(named_tensors)


def _copy_all(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """`target.copy_(source)` for each pair, on as many threads as torch has for an update large
    enough to repay them. A copy into a weight the engine keeps transposed (the reference
    engine's CPU layout) runs on one thread inside torch, at a fifth of a plain copy's speed;
    copies release the GIL, so several at once use the cores an update waits on anyway."""
    threads = torch.get_num_threads()
    nbytes = sum(source.numel() * source.element_size() for _, source in pairs)
    with torch.no_grad():
        if threads < 2 or nbytes < _PARALLEL_COPY_BYTES or len(pairs) < 2:
            for target, source in pairs:
                _copy(target, source)
            return
        # Largest first: the threads finish together.
        pairs = sorted(pairs, key=lambda pair: -pair[1].numel())
        with ThreadPoolExecutor(threads, thread_name_prefix="miles-weight-load") as pool:
            for done in pool.map(_copy_without_grad, pairs):
                del done


def _copy_without_grad(pair: tuple[Tensor, Tensor]) -> None:
    with torch.no_grad():  # grad mode is per thread: a pool thread starts with it on
        _copy(*pair)


def _copy(target: Tensor, source: Tensor) -> None:
    """`target.copy_(source)`; into a column-major matrix (a weight the engine keeps
    transposed) as the copy of the transposes, which torch runs blockwise, twice as fast as its
    element-wise strided copy (measured on the 89.9M model of `bench/weight_sync.py`)."""
    if target.dim() == 2 and target.stride() == (1, target.shape[0]) and target.shape[0] > 1:
        target.t().copy_(source.t())
    else:
        target.copy_(source)


def _known(name: str, targets: dict[str, Tensor], rename: Callable[[str], str]) -> str:
    """`name` if the model knows it, else its renaming where the model knows that; an unknown
    name stays as sent, so that the error names what was sent."""
    if name in targets:
        return name
    renamed = rename(name)
    return renamed if renamed in targets else name


def _targets(model: torch.nn.Module) -> dict[str, Tensor]:
    """Every loadable name; tied parameters appear under each of their names."""
    targets: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    config = getattr(model, "config", None)
    tied = getattr(model, "_tied_weights_keys", None)
    # Tied modules usually share one Parameter, listed under both names above; this also covers a
    # model that ties by config but does not register the tied module (transformers >= 5 maps
    # tied name -> source name here).
    if getattr(config, "tie_word_embeddings", False) and isinstance(tied, dict):
        for name, source in tied.items():
            if name not in targets and source in targets:
                targets[name] = targets[source]
            elif source not in targets and name in targets:
                targets[source] = targets[name]
    return targets


def _check(name: str, tensor: object, targets: dict[str, Tensor]) -> str | None:
    """What is wrong with loading `tensor` as `name`, or None if it loads."""
    target = targets.get(name)
    if target is None:
        close = difflib.get_close_matches(name, targets, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown name {name!r}{hint}"
    if not isinstance(tensor, Tensor):
        return f"{name!r} is a {type(tensor).__name__}, not a tensor"
    if tuple(tensor.shape) != tuple(target.shape):
        return f"{name!r} has shape {tuple(tensor.shape)} but the model's is {tuple(target.shape)}"
    if tensor.is_floating_point() and not _all_finite(tensor):
        return f"{name!r} holds NaN or infinite values"
    return None


def _all_finite(tensor: Tensor) -> bool:
    """Whether every value is finite, in one reduction for the usual tensor.

    A NaN or an infinity makes the sum NaN or infinite, so a finite sum proves every value finite
    without the elementwise mask `isfinite` allocates (a third of a small model's update time on
    the engine). Only a non-finite sum, which finite values can also give by overflowing, pays
    the exact check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
