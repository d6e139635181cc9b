"""vLLM worker extensions for the vLLM backend's tests (``tests/functional/test_vllm_generation.py``).

A test selects one by subclassing the product's server with another ``extension_cls``; vLLM imports it in
its worker process (the repository is on that process's ``PYTHONPATH``).

* ``WeightSumsExtension``: the product's refit extension, plus ``nemo_rl_weight_sums()``: ``{name: [sum,
  abs-sum, numel]}`` of every parameter of vLLM's model, so a test reads back what each parameter holds.
* ``testkit/vllm_packing_kept.py`` holds the negative control (vLLM's CPU weight packing left in place).
"""

from __future__ import annotations

from nemo_rl.models.generation.vllm_extension import VllmRefitExtension


class WeightSumsExtension(VllmRefitExtension):
    def nemo_rl_weight_sums(self) -> dict[str, list[float]]:
        out = {}
        for name, p in self.model_runner.model.named_parameters():
            t = p.detach().float()
            out[name] = [float(t.sum()), float(t.abs().sum()), int(t.numel())]
        return out
