"""The negative control of the vLLM refit check: the product's extension with vLLM's own CPU weight packing
put back (``nemo_rl/models/generation/vllm_extension.py`` replaces it when imported). Refits then write
parameters the forward no longer reads, and the check must catch it. Its own module: importing it undoes
the product's patch for the whole vLLM worker process.
"""

from __future__ import annotations

from vllm.model_executor.layers import utils as layer_utils

from nemo_rl.models.generation import vllm_extension
from testkit.vllm_extensions import WeightSumsExtension

if vllm_extension._ORIGINAL_DISPATCH is not None:
    layer_utils.dispatch_cpu_unquantized_gemm = vllm_extension._ORIGINAL_DISPATCH
    vllm_extension._ORIGINAL_DISPATCH = None  # the load reports dispatch_patched: false


class PackingKeptExtension(WeightSumsExtension):
    pass
