"""Loading a model for the engine: resolving the device, building the model
from a checkpoint's weights (quantized on the CPU when asked), its runner and
cache size, and the process settings an engine asks for.
"""

from __future__ import annotations

import atexit
import functools
import gc

import torch
from torch import nn

from formcast.engine.block_manager import BlockManager
from formcast.engine.config import DeepseekV4Config, EngineConfig, LlamaConfig
from formcast.engine.kv_groups import GroupedBlockManager, KVGroup, group_layers, size_groups
from formcast.engine.errors import UnsupportedModelError
from formcast.engine.kernels import native
from formcast.engine.kernels.native import BLOCK_TYPES
from formcast.engine.layers.quant import (QUANTIZATIONS, GGUFEmbedding, GGUFLinear,
                                          quantize_linears)
from formcast.engine.loader.gguf_blocks import Blocks, native_blocks, read_gguf_blocks
from formcast.engine.loader.gguf import (Int4Blocks, config_from_reader, open_gguf,
                                         read_int4_blocks, stores_quantized)
from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from formcast.engine.models.deepseek_v4_runner import (state_bytes_per_sequence,
                                                        state_bytes_per_token)
from formcast.engine.models.families import build_causal_lm
from formcast.engine.models.llama import LlamaForCausalLM, decoder_config
from formcast.engine.models.llama_gguf import GGUFLlamaForCausalLM
from formcast.engine.tokenizer import Tokenizer
from formcast.engine.tokenizer_files import cached_gguf_tokenizer


def load(name_or_path: str, *, device: str | torch.device, dtype: torch.dtype | None,
         quantization: str | None) -> tuple[LlamaForCausalLM | DeepseekV4ForCausalLM, Tokenizer,
                                            torch.device, str, str | None]:
    """The model and tokenizer of ``name_or_path`` (see :meth:`Engine.from_pretrained`),
    the device they are on, the model's name and the quantization its linears took."""
    from formcast.engine.hub import resolve_model
    from formcast.engine.loader import load_checkpoint

    dev = resolve_device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    source = resolve_model(name_or_path)
    tokenizer = (cached_gguf_tokenizer(source.path) if source.kind == "gguf"
                 else Tokenizer.from_hf_dir(source.path))
    if quantization not in (None, "auto", "gguf") + QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose 'auto', 'gguf', "
                         f"{', '.join(map(repr, QUANTIZATIONS))} or None")
    # "auto": a plain Llama GGUF in block types the native kernels run goes on them as
    # stored (faster than int4 and closer to float32's tokens); int4/int8 otherwise
    reader = None
    if source.kind == "gguf" and dev.type == "cpu" and dtype == torch.float32 and \
            quantization in ("auto", "gguf"):
        reader = open_gguf(source.path)  # (parsed once: a large vocabulary takes seconds)
        config = config_from_reader(reader, source.path)
        if native_blocks(reader, config) and (quantization == "gguf" or native.available()):
            config, weights = read_gguf_blocks(source.path, fuse=gguf_fusions, reader=reader)
            reader = None  # its parsed metadata (the vocabulary) is not held while building
            # the file's own blocks on the native kernels: no float32 weights at all
            return (build_gguf_model(config, weights, source.path), tokenizer, dev,
                    source.name, "gguf")
    if quantization == "gguf":
        raise ValueError("quantization='gguf' runs a Llama-architecture GGUF whose weights "
                         f"are all in {', '.join(BLOCK_TYPES)} blocks, in float32 on the CPU")
    ckpt = load_checkpoint(source)
    blocks, quantized = {}, False
    if source.kind == "gguf" and dev.type == "cpu" and quantization in ("auto", "int4"):
        reader = reader or open_gguf(source.path)
        blocks = fuse_int4_blocks(read_int4_blocks(source.path, reader=reader))
        quantized = stores_quantized(reader)
    if quantization == "auto":
        # a file's 4-bit blocks run as stored; other quantized blocks (K-quants, Q5,
        # Q8) as int8 from their dequantized weights: requantized to int4 they lose
        # greedy agreement with float32 that int8 keeps
        quantization = "int4" if blocks else "int8" if quantized else None
    model = build_model(ckpt.config, ckpt.weights, device=dev, dtype=dtype,
                        quantization=quantization, int4_blocks=blocks)
    return model, tokenizer, dev, source.name, quantization


def build_gguf_model(config: LlamaConfig, weights: dict[str, Blocks | torch.Tensor],
                     path: object = "the GGUF") -> LlamaForCausalLM:
    """A Llama model whose linears and embedding keep a GGUF's blocks as stored
    (``weights`` from :func:`read_gguf_blocks`, consumed; :class:`GGUFLinear`,
    :class:`GGUFEmbedding`; fused q|k|v and gate|up), only the norms in float32:
    one copy of the weights in memory. Each layer's step is one native call
    (:class:`GGUFLlamaForCausalLM`)."""
    with torch.device("meta"):
        model = GGUFLlamaForCausalLM(config)

    fusions = {names: fused for fused, names in gguf_fusions(config).items()}

    def linear(*names: str) -> GGUFLinear:
        fused = fusions.get(names)
        parts = [weights.pop(fused)] if fused in weights else [weights.pop(n) for n in names]
        bias = None
        if config.attention_bias or config.mlp_bias:
            biases = [weights.pop(n.replace(".weight", ".bias"), None) for n in names]
            bias = None if any(b is None for b in biases) else torch.cat(biases)
        return GGUFLinear([(p.data, p.qtype) for p in parts], parts[0].in_features, bias)

    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = linear(*(f"{pre}.self_attn.{p}_proj.weight" for p in "qkv"))
        attn.o_proj = linear(f"{pre}.self_attn.o_proj.weight")
        mlp.gate_up_proj = linear(f"{pre}.mlp.gate_proj.weight", f"{pre}.mlp.up_proj.weight")
        mlp.down_proj = linear(f"{pre}.mlp.down_proj.weight")
    embed = weights.pop("model.embed_tokens.weight")
    model.model.embed_tokens = GGUFEmbedding(embed.data, embed.qtype, config.hidden_size)
    head = weights.pop("lm_head.weight", embed)  # (tied: the embedding's blocks)
    model.lm_head = GGUFLinear([(head.data, head.qtype)], config.hidden_size)
    # what is left on the meta device (norms) is allocated and loaded
    for name, param in list(model.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, leaf, nn.Parameter(weights.pop(name).float(), requires_grad=False))
    if weights:
        raise UnsupportedModelError(f"{path}: tensors formcast does not use: "
                                    f"{', '.join(sorted(weights)[:5])}")
    return model.eval()


def gguf_fusions(config: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """The weights a Llama runs as one projection (q|k|v, gate|up), by fused name."""
    out = {}
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}"
        out[f"{pre}.self_attn.qkv_proj.weight"] = tuple(
            f"{pre}.self_attn.{p}_proj.weight" for p in "qkv")
        out[f"{pre}.mlp.gate_up_proj.weight"] = (f"{pre}.mlp.gate_proj.weight",
                                                 f"{pre}.mlp.up_proj.weight")
    return out


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda[:N]'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
    return dev


def build_model(config: LlamaConfig | DeepseekV4Config, weights: dict[str, torch.Tensor], *,
                device: torch.device, dtype: torch.dtype, quantization: str | None = None,
                int4_blocks: dict | None = None) -> LlamaForCausalLM | DeepseekV4ForCausalLM:
    """Instantiate the model without random init, load weights, move to device/dtype,
    and optionally quantize its linear layers ("int4" or "int8", CPU only, Llama only).

    A DeepSeek-V4 model gets its MTP layer when ``weights`` hold ``mtp.0.*`` tensors,
    and keeps in float32 what DeepSeek keeps there (norms, hyper-connection maps, sinks).
    """
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on the CPU only; "
                         f"use quantization=None on {device.type}")
    if isinstance(config, DeepseekV4Config):
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} is not available for DeepSeek-V4; "
                             "use quantization=None")
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(config, with_mtp=any(n.startswith("mtp.0.") for n in weights))
        model.to_empty(device="cpu")
        model.load_weights(weights)
        return model.cast_(dtype).to(device).eval()
    with torch.device("meta"):
        model = build_causal_lm(config)  # Llama or a family sharing its module
    model.to_empty(device="cpu")
    model.tie_weights()
    model.load_weights(weights)
    model = model.to(device=device, dtype=dtype).eval()
    if quantization is not None:
        quantize_linears(model, quantization, blocks=int4_blocks)
    return model


def fuse_int4_blocks(blocks: dict[str, Int4Blocks]) -> dict[str, Int4Blocks]:
    """A GGUF's per-projection 4-bit blocks (transformers names) under the engine's
    layer names, fused as its Llama runs them (q, k, v -> qkv_proj; gate, up ->
    gate_up_proj). A fused layer whose parts are not all 4-bit is left out (it is
    quantized from float instead)."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out: dict[str, Int4Blocks] = {}
    for name in blocks:
        if name.count(".") < 2:  # ("lm_head.weight": the head is quantized on its own)
            continue
        stem, part, _ = name.rsplit(".", 2)  # "model.layers.0.mlp", "up_proj", "weight"
        for layer, parts in fused.items():
            if part == parts[0]:
                names = [f"{stem}.{p}.weight" for p in parts]
                if all(n in blocks for n in names):
                    out[f"{stem}.{layer}"] = Int4Blocks.cat([blocks[n] for n in names])
        if part in ("o_proj", "down_proj"):
            out[f"{stem}.{part}"] = blocks[name]
    return out


def state_blocks(config: EngineConfig, model_config: DeepseekV4Config, dtype: torch.dtype,
                  max_rollback: int) -> int:
    """Admission blocks for a DeepSeek-V4 engine: the tokens whose growing state fits
    in ``kv_cache_memory`` after every request's fixed part (windows, raw rows), capped
    at what ``max_num_seqs`` full-length requests could use and at 2**16 blocks."""
    bs = config.block_size
    fixed = config.max_num_seqs * state_bytes_per_sequence(model_config, dtype, max_rollback)
    free = max(config.kv_cache_memory - fixed, config.kv_cache_memory // 4)
    fit = free // (bs * state_bytes_per_token(model_config, dtype))
    longest = -(-min(config.max_model_len or model_config.max_position_embeddings,
                     model_config.max_position_embeddings) // bs)
    return max(1, min(fit, config.max_num_seqs * longest, 2 ** 16))


def max_len(config: EngineConfig, model_config: LlamaConfig | DeepseekV4Config,
            num_blocks: int | None) -> int:
    """The longest sequence: the model's context, capped by the config and by the
    cache (a sequence must always fit alone in its ``num_blocks``; None: the
    cache sets no bound, its layers' windows do)."""
    mpe = model_config.max_position_embeddings
    cap = mpe if num_blocks is None else num_blocks * config.block_size
    return min(config.max_model_len or mpe, mpe, cap)


def full_blocks(groups: tuple[KVGroup, ...]) -> int | None:
    """The blocks of the full-attention group of ``groups`` (None: none has one)."""
    return next((g.num_blocks for g in groups if g.window is None), None)


def rollback_margin(config: EngineConfig) -> int:
    """Tokens a rollback may take back without losing a sliding window: a whole
    rejected draft, and at least 16 (a constraint's dead end backed out of)."""
    return max(16, config.spec.max_draft + 1)


def block_manager_for(groups: tuple[KVGroup, ...], config: EngineConfig, *,
                      prefix_caching: bool) -> BlockManager | GroupedBlockManager:
    """The block manager of a runner's KV ``groups``: a plain one for one
    full-attention group, else one per group (:class:`GroupedBlockManager`)."""
    if len(groups) == 1 and groups[0].window is None:
        return BlockManager(groups[0].num_blocks, config.block_size,
                            enable_prefix_caching=prefix_caching)
    return GroupedBlockManager(groups, config.block_size, enable_prefix_caching=prefix_caching,
                               margin=rollback_margin(config),
                               free_out_of_window=config.free_out_of_window_blocks)


def build_runner(model: LlamaForCausalLM | DeepseekV4ForCausalLM, tokenizer: Tokenizer,
                 config: EngineConfig, *, device: torch.device, dtype: torch.dtype):
    """The model runner for ``model``, its KV groups (sized), whether prefix
    caching is on, and the MTP proposer when the model drafts with its own head.
    (DeepSeek-V4 keeps its sliding windows in per-request states, bounded by the
    window: its one group of blocks only admits requests.)

    Raises
    ------
    ValueError
        Speculative method "mtp" for a model without an MTP layer.
    """
    from formcast.engine.cuda_graph import graph_ladder
    from formcast.engine.model_runner import ModelRunner, kv_bytes_per_block, layer_block_bytes
    from formcast.engine.models.deepseek_v4_runner import DeepseekV4Runner
    from formcast.engine.speculative.mtp import MTPProposer

    mcfg, bs, spec = model.config, config.block_size, config.spec
    mtp = None
    if isinstance(model, DeepseekV4ForCausalLM):
        max_rollback = max(16, spec.max_draft + 1)  # a whole rejected draft truncates
        num_blocks = config.num_kv_blocks or state_blocks(config, mcfg, dtype, max_rollback)
        # "auto" drafts on float32 engines only (see SpeculativeDecoder.draft_mode)
        uses_mtp = len(model.mtp) > 0 and spec.enabled and (
            spec.method == "mtp" or (spec.method == "auto" and dtype == torch.float32))
        # per-request states, not paged KV: blocks only admit requests, nothing is shared
        prefix_caching = False
        runner = DeepseekV4Runner(model, max_rollback=max_rollback, keep_hidden=uses_mtp,
                                  batch_invariant=config.batch_invariant_on(device.type))
        groups = (KVGroup(window=None, layers=tuple(range(mcfg.num_hidden_layers)),
                          num_blocks=num_blocks),)
        if uses_mtp:
            mtp = MTPProposer(runner, valid_vocab_size=tokenizer.vocab_size)
    else:
        # no more than the admitted requests can fill at the model's context (the
        # CPU commits a block's memory when it is first written: runner.zeroed_cache)
        context = min(config.max_model_len or mcfg.max_position_embeddings,
                      mcfg.max_position_embeddings)
        memory = min(config.kv_cache_memory, config.max_num_seqs * -(-context // bs)
                     * kv_bytes_per_block(mcfg, bs, dtype))
        windows = tuple(decoder_config(mcfg).window(i) for i in range(mcfg.num_hidden_layers))
        groups = size_groups(group_layers(windows),
                             layer_block_bytes=layer_block_bytes(mcfg, bs, dtype),
                             memory=memory, num_blocks=config.num_kv_blocks,
                             max_num_seqs=config.max_num_seqs, margin=rollback_margin(config),
                             block_size=bs, lookahead=spec.max_draft + 1,
                             step_tokens=config.max_num_batched_tokens)
        prefix_caching = config.enable_prefix_caching
        # (graphs serve one full-attention group: sliding-window models run eagerly)
        graph_sizes = graph_ladder(config.max_num_seqs) if config.cuda_graphs and \
            device.type == "cuda" and len(groups) == 1 and groups[0].window is None else ()
        runner = ModelRunner(model, num_blocks=groups[0].num_blocks, block_size=bs,
                             device=device, dtype=dtype, cuda_graph_sizes=graph_sizes,
                             kv_groups=groups,
                             max_model_len=max_len(config, mcfg, full_blocks(groups)),
                             sample_vocab=min(tokenizer.vocab_size, mcfg.vocab_size),
                             max_prefill_tokens=config.max_num_batched_tokens,
                             max_prefill_chunks=config.max_num_seqs, tuning=config.tuning,
                             batch_invariant=config.batch_invariant_on(device.type))
    if spec.enabled and spec.method == "mtp" and mtp is None:
        raise ValueError("spec method 'mtp' needs a model with an MTP layer (a DeepSeek-V4 "
                         "checkpoint with mtp.0.* weights); use 'prompt_lookup' or 'auto'")
    return runner, groups, prefix_caching, mtp


def settle_process(config: EngineConfig, device: torch.device) -> None:
    """The process-wide settings an engine asks for as it is built: torch's CPU
    threads (``num_threads``), and the heap moved out of the collector's way
    (``freeze_gc``)."""
    if config.num_threads is not None and device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    freeze = config.freeze_gc
    if freeze if freeze is not None else device.type == "cuda":
        gc.collect()
        gc.freeze()
        _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    """Hand frozen objects back to the collector when the interpreter exits: its
    last collection skips the permanent generation, and extension modules that
    count their objects at shutdown (Triton's, through nanobind) would report
    every one of them as leaked."""
    atexit.register(gc.unfreeze)
