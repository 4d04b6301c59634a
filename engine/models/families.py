"""The model families formcast runs on the Llama path, and the class each builds.

- Llama (SmolLM2, Llama 2/3): the reference.
- Qwen2/2.5: biases on the q, k and v projections (none on the output one).
- Qwen3: per-head RMSNorm of queries and keys before the rotation, no biases.
- Mistral: sliding-window attention (a Mistral GGUF says ``llama``; its window,
  if any, is in ``llama.attention.sliding_window``).
- Gemma 3: :mod:`formcast.engine.models.gemma3`.
- Phi-3: fused ``qkv_proj`` / ``gate_up_proj`` in its checkpoints (the engine's own
  fused layout), LongRoPE scaling, a sliding window where configured.

All but Gemma 3 are :class:`LlamaForCausalLM` built from a
:class:`~formcast.engine.models.decoder_config.DecoderConfig`: they differ from Llama
in details that module reads. Each runs on the paged KV cache, CUDA graphs, the
Triton kernels, speculative decoding and quantized CPU linears as Llama does.
"""

from __future__ import annotations

from formcast.engine.config import LlamaConfig
from formcast.engine.models.gemma3 import Gemma3ForCausalLM
from formcast.engine.models.llama import LlamaForCausalLM

CAUSAL_LMS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": LlamaForCausalLM,
}
FAMILIES: tuple[str, ...] = tuple(CAUSAL_LMS)


def causal_lm_class(config: LlamaConfig) -> type[LlamaForCausalLM]:
    """The model class of ``config``'s family (``config.architecture``).

    Raises ``ValueError`` for an architecture outside :data:`FAMILIES`.
    """
    try:
        return CAUSAL_LMS[config.architecture]
    except KeyError:
        raise ValueError(f"no model class for architecture {config.architecture!r} "
                         f"(supported: {', '.join(FAMILIES)})") from None


def build_causal_lm(config: LlamaConfig) -> LlamaForCausalLM:
    """A model of ``config``'s family (on the current default device: ``meta`` to
    build without initializing)."""
    return causal_lm_class(config)(config)
