"""Configuration dataclasses: the model's shape and the engine's knobs.

DeepSeek-V4's shape lives in :mod:`formcast.engine.deepseek_v4_config` (re-exported here).

Both are frozen and keyword-only. Values only known at run time (the number of KV
blocks that fit, eos ids read from the tokenizer) live in runtime state, never here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from formcast.engine.tuning import EngineTuning


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama-family decoder (names follow transformers' LlamaConfig)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    architecture: str = "llama"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build from a transformers ``config.json`` dictionary."""
        heads = d["num_attention_heads"]
        # transformers >= 5 writes RoPE settings (theta and any scaling) as rope_parameters.
        rope_params = d.get("rope_parameters") or {}
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            mlp_bias=d.get("mlp_bias", False),
        )


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Knobs of the engine; every field has a sensible default.

    Parameters
    ----------
    block_size : int
        Tokens per KV-cache block.
    num_kv_blocks : int | None
        KV blocks to allocate; None sizes the cache from ``kv_cache_memory``.
    kv_cache_memory : int
        Bytes for the KV cache when ``num_kv_blocks`` is None.
    max_num_seqs : int
        Most requests in one running batch.
    max_num_batched_tokens : int
        Token budget of one step (prefill chunks plus decode tokens).
    max_model_len : int | None
        Longest sequence (prompt + output); None takes the model's context length.
    enable_prefix_caching : bool
        Share KV blocks between requests whose prompts start alike.
    free_out_of_window_blocks : bool
        A sliding-window layer's KV blocks that no query can see any more (every
        position older than the window, with a margin for rollbacks) go back to the
        pool as decoding moves on, so a request's memory for those layers is bounded
        by the window (:mod:`formcast.engine.kv_groups`). False keeps them to the
        end of the request; outputs are the same either way.
    spec : SpecConfig | str | None
        Speculative decoding (:class:`formcast.engine.speculative.SpecConfig`, or a method
        name: "auto", "prompt_lookup", "none"). Default "auto": greedy requests
        draft while few requests run; outputs are identical either way.
    max_constraint_rollbacks : int
        How often one request may back out of a dead end its constraint can explain
        (``rollback_hint()``: a finished value failed an end check) by rolling back
        to the offending value and sampling again with the token that led there
        banned. 0 turns recovery off: such a request ends at once with an error.
    num_threads : int | None
        CPU threads for the model (``torch.set_num_threads``, process-wide, applied
        when the engine is built). None keeps torch's default, one per physical
        core, which measured best on 2- to 8-core machines: decode on a CPU is
        bound by memory bandwidth, and hyper-threads only contend for it.
    overlap_masks : bool
        Fill the grammar masks of a step's constrained rows on a worker thread while
        the model runs (the grammar library releases the GIL), instead of after it.
    unmasked_greedy : bool
        In asynchronous decoding, a greedy constrained request takes the argmax of
        its unmasked logits (on CUDA sampled inside the decode graph, with the
        unconstrained rows) and the host checks that token against the constraint
        when it takes it, instead of filling a mask before sampling. Only a refused
        pick costs a mask: the row is resampled under it from the same logits (kept
        on the device for one more step) and its forward in the step already
        launched is dropped. The tokens are exactly those of masked greedy decoding
        (when the unmasked argmax is allowed it is the argmax among allowed tokens),
        and while the model's picks conform the host fills no masks at all. After a
        refused pick a request is masked as usual until its masked pick is again
        its unmasked argmax (both are computed on the device); when refusals come
        back before an unmasked pick is taken, until that happens 2, 4, 8, then 16
        times in a row.
    native_accept : bool | None
        In asynchronous decoding of a large batch, the unmasked picks of its
        xgrammar rows (``unmasked_greedy``) are offered to their constraints by a
        native thread outside the interpreter
        (``formcast/grammars/backends/xgrammar/native_accept.c``, built with the system's C
        compiler on first use and cached) from the moment the step's tokens land
        in host memory; the host reads the verdicts when it takes the step.
        Otherwise, or where it cannot be built, an accept thread in Python checks
        them, taking the interpreter lock around xgrammar's call. None: on CUDA.
    cuda_graphs : bool
        On CUDA, capture the decode step as CUDA graphs at batch sizes 1, 2, 4, ...
        up to ``max_num_seqs`` when the engine starts (Llama models), and replay
        them for decode steps; steps of prompt chunks alone replay graphs as well,
        each captured the first time a step of its padded size runs
        (:mod:`formcast.engine.prefill_graph`). False runs every step eagerly.
    async_scheduling : bool | None
        In steady decoding, launch each step with the last step's samples still on
        the device and take them on the host (grammars, text, stops, next masks)
        while it runs; a batch of 8 or more requests that start together has its
        prompts' step sampled that way too. None: on CUDA (Llama models). While an
        accept thread checks a large batch's unmasked greedy picks, the
        interpreter's GIL switch interval (process-wide) is at most 0.2 ms; the
        process's own comes back when that ends.
    jump_forward : bool | None
        A constrained request whose grammar fixes the start of its output (a JSON
        Schema's ``{"records":[{"name":"``) has those tokens appended to its prompt's
        prefill as it is queued (the constraint's ``take_forced_tokens``, else its
        ``forced_tokens``), rather than decoded one step each under masks that
        allow nothing else. They are output tokens all the same (counted against
        ``max_tokens``, one at least left to sample; ``num_forced_tokens``). The text
        is the grammar's; the tokens are the longest ones that spell it, which
        masked decoding may have split otherwise, and their KV comes from the
        prefill, which in reduced precision rounds differently from one token a
        step (as a preempted request's recompute does). Not for requests with stop
        strings or logprobs, nor where a taken token is an end or stop token.
        None: on CUDA, where each of those tokens would cost a decode step of the
        whole batch (at 256 rows of the GPU benchmark's JSON, 7 steps, masked).
        On the CPU, speculative decoding ("auto") verifies them several to a
        forward instead, keeping the tokens of greedy decoding.
    freeze_gc : bool | None
        Once the engine is built, collect garbage and then move every object alive
        to the garbage collector's permanent generation (``gc.freeze()``,
        process-wide), so that its full collections, which the allocations of
        steady decoding set off now and then, walk only newer objects rather than
        the whole heap (the tokenizer's tables, torch's modules: tens to hundreds
        of milliseconds a collection). The catch: objects alive then (the engine
        too) are never freed by the cycle collector later, only by reference
        counting. None: on CUDA.
    pause_gc : bool | None
        Keep the cycle collector off while :meth:`Engine.generate` runs (as it was
        before the call once it returns). A batch's steps leave no cyclic garbage
        of their own; the collections their allocations set off land on the
        last step of a large batch, where its requests end at once and rows set
        back a step wait. Cycles that
        constraints or callbacks make are collected after the call. None: on
        CUDA.
    batch_invariant : bool | None
        Batch-invariant mode: a request's tokens and logprobs are bitwise the same
        whatever it shares a step with (batch composition and order, chunked-prefill
        boundaries, prefix-cache hits, preemption, speculative verification). Every
        row then attends by one fixed-split computation, GEMMs see fixed row tiles,
        and draws use noise keyed by (seed, position) only (see "Batch invariance"
        in docs/architecture.md). None: on for the CPU, off on CUDA.
    tuning : EngineTuning
        Performance knobs (:class:`formcast.engine.tuning.EngineTuning`, or a dict
        of its fields) that move work between threads and waits without changing
        any output.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 512 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    free_out_of_window_blocks: bool = True
    max_constraint_rollbacks: int = 8
    num_threads: int | None = None
    overlap_masks: bool = True
    unmasked_greedy: bool = True
    native_accept: bool | None = None
    cuda_graphs: bool = True
    async_scheduling: bool | None = None
    jump_forward: bool | None = None
    freeze_gc: bool | None = None
    pause_gc: bool | None = None
    spec: Any = None  # SpecConfig after __post_init__
    batch_invariant: bool | None = None
    tuning: EngineTuning = EngineTuning()  # (a dict of its fields is taken too)

    def __post_init__(self) -> None:
        from formcast.engine.speculative.config import SpecConfig

        object.__setattr__(self, "spec", SpecConfig.coerce(self.spec))
        tuning = self.tuning
        if isinstance(tuning, dict):
            tuning = EngineTuning(**tuning)
        elif not isinstance(tuning, EngineTuning):
            raise ValueError(f"tuning must be an EngineTuning or a dict of its fields, got "
                             f"{type(tuning).__name__}")
        object.__setattr__(self, "tuning", tuning)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or self.num_threads <= 0):
            raise ValueError(f"num_threads must be a positive int or None, got {self.num_threads!r}")
        if self.max_constraint_rollbacks < 0:
            raise ValueError(f"max_constraint_rollbacks must be >= 0, got "
                             f"{self.max_constraint_rollbacks}")
        if self.batch_invariant not in (None, True, False):
            raise ValueError(f"batch_invariant must be True, False or None, got "
                             f"{self.batch_invariant!r}")

    def batch_invariant_on(self, device_type: str) -> bool:
        """Whether batch-invariant mode is on for a device of ``device_type``
        ("cpu", "cuda"): the field, or by default on the CPU only."""
        if self.batch_invariant is None:
            return device_type == "cpu"
        return self.batch_invariant


from formcast.engine.deepseek_v4_config import (  # noqa: E402  (re-exported)
    DEEPSEEK_V4_LAYER_TYPES, DEEPSEEK_V4_MLP_TYPES, DeepseekV4Config, RopeSpec)

__all__ = ["LlamaConfig", "EngineConfig", "DeepseekV4Config", "RopeSpec",
           "DEEPSEEK_V4_LAYER_TYPES", "DEEPSEEK_V4_MLP_TYPES"]
