"""Find a model's repeated blocks: the units every whole-model strategy works on.

The rule: among the containers (``nn.ModuleList``, ``nn.Sequential``) whose children are two or
more modules of one class, take the class with the most such children in the model (ties: the
one with more parameters per block), and every child of that class in those containers; then
where that class fills its containers, every other class that fills its own containers, whose
blocks have submodules and neither hold nor lie in blocks already taken (an encoder-decoder's
encoder layers beside its decoder layers), all in module order. That finds
``transformer.h`` (GPT-2, nanoGPT), ``model.layers`` (Llama, Qwen2), ``bert.encoder.layer``,
``encoder.layers`` (``nn.TransformerEncoder``), ``model.encoder.layers`` and
``model.decoder.layers`` (BART, Whisper) and the residual blocks of every stage of a ResNet
(``layer1.0`` .. ``layer4.1``). ``one_class=True`` stops after the first class (one stack).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy

from ..errors import InvalidArgumentError, InvalidInputTypeError

__all__ = ["Blocks", "enclosing_blocks", "find_blocks", "model_digest"]

#: What ``blocks=`` takes: an attribute path (``"model.layers"``) or a filter
#: ``(module, fqn) -> bool`` selecting the blocks themselves.
Blocks = str | Callable[[nn.Module, str], bool] | None


def find_blocks(
    model: nn.Module, blocks: Blocks = None, *, option: str = "blocks", one_class: bool = False
) -> list[tuple[str, nn.Module]]:
    """The model's blocks as ``(fully qualified name, module)`` pairs, in module order;
    ``option``: the caller's name for ``blocks``, in the messages; ``one_class``: of the
    default rule, the first class's blocks only (one stack)."""
    if not isinstance(model, nn.Module):
        raise InvalidInputTypeError(f"expected an nn.Module, got {type(model).__name__}")
    if blocks is None:
        found = _repeated(model, option, one_class=one_class)
    elif isinstance(blocks, str):
        found = _at_path(model, blocks, option)
    elif callable(blocks):
        found = _filtered(model, blocks, option)
    else:
        raise InvalidInputTypeError(
            f"{option}= takes an attribute path such as 'model.layers' or a function "
            f"(module, fqn) -> bool, got {type(blocks).__name__}"
        )
    _check_disjoint(found)
    _refuse_lazy(found)
    return found


def _refuse_lazy(found: list[tuple[str, nn.Module]]) -> None:
    """The blocks' lazy parameters have no shape until a first forward, and a recompute
    cannot repeat the draws of their first call (torch's raw ``ValueError`` from inside the
    block search, before); lazy modules outside the blocks run as they are."""
    lazy = next(
        (f"{fqn}.{n}" for fqn, b in found for n, p in b.named_parameters() if is_lazy(p)), None
    )
    if lazy is not None:
        raise InvalidArgumentError(
            f"parameter {lazy} is not initialised yet (a lazy module, such as nn.LazyLinear, "
            "shapes its parameters on its first call): run the model's forward once on a "
            "batch, e.g. under torch.no_grad(), before revckpt plans or converts it"
        )


def _containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2
    ]


def _runs(name: str, container: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The container's children in runs of consecutive ones of one class (a whole ModuleList
    of blocks is one run; ``Sequential(stem, block, block, block, head)`` has a run of three)."""
    runs: list[list[tuple[str, nn.Module]]] = []
    for child_name, child in container.named_children():
        fqn = f"{name}.{child_name}" if name else child_name
        if runs and type(runs[-1][-1][1]) is type(child):
            runs[-1].append((fqn, child))
        else:
            runs.append([(fqn, child)])
    return runs


def enclosing_blocks(
    model: nn.Module, found: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]] | None:
    """The repeated blocks of another class that hold every one of ``found`` (the layers
    around a layer's experts), or ``None``."""
    try:
        outer = _repeated(model, "blocks", exclude={type(m) for _, m in found})
    except InvalidArgumentError:
        return None
    prefixes = tuple(f"{fqn}." for fqn, _ in outer)
    return outer if all(fqn.startswith(prefixes) for fqn, _ in found) else None


def _repeated(
    model: nn.Module, option: str, exclude: set[type] | None = None, one_class: bool = False
) -> list[tuple[str, nn.Module]]:
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    whole: dict[type, bool] = {}  # each of its runs is a whole container (a stack of layers)
    for name, container in _containers(model):
        for run in _runs(name, container):
            kind = type(run[0][1])
            if len(run) >= 2 and not (exclude and kind in exclude):
                by_class.setdefault(kind, []).extend(run)
                whole[kind] = whole.get(kind, True) and len(run) == len(container)
    # blocks with trainable parameters first; else frozen ones (a backward to a trainable
    # embedding or prompt still runs through them and keeps their activations)
    trainable = {k: v for k, v in by_class.items() if _has_parameters(v)}
    by_class = trainable or {k: v for k, v in by_class.items() if _has_weights(v)}
    if not by_class:
        shared = [
            name
            for name, c in _containers(model)
            if len(set(map(id, c))) < len(c) and _has_parameters([(name, m) for m in c])
        ]
        because = (
            f" ({shared[0]} holds one module several times: shared weights, which run as one "
            "block called several times per step and are not planned)"
            if shared
            else ""
        )
        raise InvalidArgumentError(
            f"{type(model).__name__} has no repeated blocks (no two or more consecutive "
            "modules of one class with parameters in an nn.ModuleList or nn.Sequential)"
            f"{because}; name them with {option}='attribute.path' or "
            f"{option}=lambda module, fqn: ..."
        )

    def rank(kind: type) -> tuple[int, int]:
        members = by_class[kind]
        sizes = (p.numel() for p in members[0][1].parameters() if not is_lazy(p))
        return len(members), sum(sizes)

    first, *others = sorted(by_class, key=rank, reverse=True)
    taken = list(by_class[first])
    for kind in others if whole[first] and not one_class else ():
        # another stack of layers (an encoder-decoder's): a whole container of modules with
        # submodules of their own, apart from the blocks taken; not a run beside other
        # layers (first-k dense layers before mixture-of-experts ones), not a list of
        # Linears or Embeddings (heads, codebooks)
        members = by_class[kind]
        layers = any(True for _ in members[0][1].children())
        if whole[kind] and layers and _apart(members, taken):
            taken.extend(members)
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    return sorted(taken, key=lambda item: order[item[0]])


def _apart(members: list[tuple[str, nn.Module]], taken: list[tuple[str, nn.Module]]) -> bool:
    """No block of ``members`` holds or lies in a block of ``taken`` (nor is one)."""
    return not any(
        a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.") or not a or not b
        for a, _ in members
        for b, _ in taken
    )


def _has_parameters(members: list[tuple[str, nn.Module]]) -> bool:
    return any(p.requires_grad for _, m in members for p in m.parameters())


def _has_weights(members: list[tuple[str, nn.Module]]) -> bool:
    return any(True for _, m in members for _ in m.parameters())


def _at_path(model: nn.Module, path: str, option: str) -> list[tuple[str, nn.Module]]:
    target: Any = model
    walked: list[str] = []
    for part in path.split(".") if path else []:
        child = target._modules.get(part) if isinstance(target, nn.Module) else None
        if child is None:
            here = ".".join(walked) or type(model).__name__
            options = sorted(target._modules) if isinstance(target, nn.Module) else []
            raise InvalidArgumentError(
                f"{option}={path!r}: {here} has no submodule {part!r} (it has {options[:12]}); "
                "pass the attribute path of the container of blocks, e.g. 'model.layers'"
            )
        walked.append(part)
        target = child
    if not isinstance(target, (nn.ModuleList, nn.Sequential)) or len(target) < 1:
        raise InvalidArgumentError(
            f"{option}={path!r} is a {type(target).__name__}, not an nn.ModuleList or "
            f"nn.Sequential of blocks; pass the container's path, or {option}=lambda module, "
            "fqn: ... to pick the blocks themselves"
        )
    return [(f"{path}.{name}" if path else name, m) for name, m in target.named_children()]


def _filtered(
    model: nn.Module, keep: Callable[[nn.Module, str], bool], option: str
) -> list[tuple[str, nn.Module]]:
    found = [(fqn, m) for fqn, m in model.named_modules() if fqn and keep(m, fqn)]
    if not found:
        raise InvalidArgumentError(
            f"{option}=<function> selected no module; it is called as fn(module, fqn) for every "
            "submodule and returns True for the blocks"
        )
    return found


def _check_disjoint(found: list[tuple[str, nn.Module]]) -> None:
    names = [fqn for fqn, _ in found]
    for fqn in names:
        inner = [other for other in names if other.startswith(fqn + ".")]
        if inner:
            raise InvalidArgumentError(
                f"the blocks overlap: {inner[0]!r} is inside {fqn!r}; select blocks none of "
                "which contains another"
            )
    seen: dict[int, str] = {}
    for fqn, m in found:
        if id(m) in seen:
            raise InvalidArgumentError(
                f"blocks {seen[id(m)]!r} and {fqn!r} are the same module; a block used twice "
                "cannot be planned as two"
            )
        seen[id(m)] = fqn


def model_digest(model: nn.Module) -> str:
    """A digest of the model's parameter names, shapes and dtypes."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]
