"""Qwen2, Qwen3, Mistral, Gemma 3 and Phi-3 through the whole engine, held against
transformers: tiny random models (tests/engine/model_families.py) saved by
transformers as HF folders and written as GGUF files, loaded by formcast; logits
within 1e-4 in float32 and greedy generation identical for 32 tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from formcast.engine import Engine, SamplingParams
from formcast.engine.config import EngineConfig
from formcast.engine.errors import UnsupportedModelError
from formcast.engine.hub import ModelSource
from formcast.engine.loader import load_checkpoint
from formcast.engine.loading import build_model
from formcast.engine.tokenizer import Tokenizer
from tests.engine.deepseek_v4_folders import write_tokenizer
from tests.engine.deepseek_v4_helpers import _one_thread  # noqa: F401  (autouse)
from tests.engine.model_families import GGUF_CASES, HF_CASES, VOCAB, WINDOW, reference, write_gguf

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
GENERATED = 32


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, Path, object]]:
    """case -> (HF folder, GGUF file, transformers' model)."""
    out = {}
    for case in sorted(set(HF_CASES) | set(GGUF_CASES)):
        folder = tmp_path_factory.mktemp(case)
        ref = reference(transformers, case)
        ref.save_pretrained(folder)
        write_tokenizer(folder, VOCAB)
        gguf_path = folder / f"{case}.gguf"
        if case in GGUF_CASES:
            write_gguf(gguf_path, ref, case)
        out[case] = folder, gguf_path, ref
    return out


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(saved, case: str, kind: str, **config) -> Engine:
    folder, gguf_path, _ = saved[case]
    config = {"spec": "none", "max_num_batched_tokens": 7, **config}  # chunked prefill
    if kind == "hf":
        return Engine.from_pretrained(str(folder), device="cpu", **config)
    ckpt = load_checkpoint(ModelSource(name=case, kind="gguf", path=gguf_path), cache=False)
    model = build_model(ckpt.config, ckpt.weights, device=torch.device("cpu"),
                        dtype=torch.float32)
    return Engine(model, Tokenizer.from_hf_dir(folder), config=EngineConfig(**config))


def _reference_generate(ref, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                          dtype=torch.long),
                           max_new_tokens=GENERATED, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


CASES = [(c, "hf") for c in HF_CASES] + [(c, "gguf") for c in GGUF_CASES]


@pytest.mark.parametrize("case, kind", CASES)
def test_logits_match_transformers(saved, case: str, kind: str) -> None:
    ids = _prompt(24, 1)
    with torch.no_grad():
        want = saved[case][2](torch.tensor([ids])).logits[0]
    got = _engine(saved, case, kind).forward_logits(ids)
    assert (got - want).abs().max().item() <= ATOL


@pytest.mark.parametrize("case, kind", CASES)
def test_greedy_generation_matches_transformers(saved, case: str, kind: str) -> None:
    ref = saved[case][2]
    ids = _prompt(20, 2)
    want = _reference_generate(ref, ids)
    with torch.no_grad():
        full = ref(torch.tensor([ids + want])).logits[0, len(ids) - 1:-1]
    top2 = full.topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3  # no near-tie could flip an argmax
    out = _engine(saved, case, kind).generate(
        [ids], SamplingParams(max_tokens=GENERATED, temperature=0.0, ignore_eos=True,
                              logprobs=0))[0]
    assert list(out.token_ids) == want
    # each decode step's distribution is the full forward's at that position
    expected = torch.log_softmax(full, dim=-1)[torch.arange(GENERATED), torch.tensor(want)]
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    assert (got - expected).abs().max().item() <= ATOL


@pytest.mark.parametrize("case", ["mistral", "gemma3", "phi3"])
def test_the_window_matters(saved, case: str) -> None:
    """The same weights without the sliding window give other logits past it: the
    comparisons above would catch a window left out."""
    ids = _prompt(24, 1)
    ref = saved[case][2]
    wide = transformers.AutoModelForCausalLM.from_config(
        ref.config.__class__(**{**ref.config.to_dict(), "sliding_window": None}
                             if case != "gemma3" else
                             {**ref.config.to_dict(), "sliding_window": 1000}),
        attn_implementation="eager").eval()
    wide.load_state_dict(ref.state_dict())
    got = _engine(saved, case, "hf").forward_logits(ids)
    with torch.no_grad():
        unwindowed = wide(torch.tensor([ids])).logits[0]
    assert (got[:WINDOW] - unwindowed[:WINDOW]).abs().max().item() <= ATOL
    assert (got[WINDOW + 4:] - unwindowed[WINDOW + 4:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("case", ["mistral", "gemma3"])
def test_speculative_greedy_output_is_identical(saved, case: str) -> None:
    """Prompt-lookup drafts verified over sliding-window layers: the same tokens."""
    ids = _prompt(12, 3) * 3  # (repeats: drafts to take)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _engine(saved, case, "hf").generate([ids], params)[0].token_ids
    spec = _engine(saved, case, "hf", spec="prompt_lookup").generate([ids], params)[0]
    assert list(spec.token_ids) == list(plain)


@pytest.mark.parametrize("case, quantization", [("qwen2", "int8"), ("gemma3", "int4"),
                                                ("phi3", "int4")])
def test_quantized_cpu_linears_run_each_family(saved, case: str, quantization: str) -> None:
    """Quantized linears (biases, a tied head, a fused checkpoint): generation runs
    and its first token is the float model's (the prompt runs on float weights)."""
    folder = str(saved[case][0])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = _prompt(16, 4)
    want = Engine.from_pretrained(folder, device="cpu", spec="none").generate([ids], params)[0]
    got = Engine.from_pretrained(folder, device="cpu", spec="none",
                                 quantization=quantization).generate([ids], params)[0]
    assert len(got.token_ids) == 8
    assert got.token_ids[0] == want.token_ids[0]


@pytest.mark.parametrize("case, family, window", [
    ("qwen2", "qwen2", None), ("qwen3", "qwen3", None), ("mistral", "llama", WINDOW),
    ("gemma3_gguf", "gemma3", WINDOW), ("phi3", "phi3", 12), ("phi3_qkv", "phi3", 12)])
def test_gguf_config_says_family_and_window(saved, case: str, family: str, window) -> None:
    from formcast.engine.loader import read_gguf_config

    config = read_gguf_config(saved[case][1])
    assert config.architecture == family
    assert config.sliding_window == window


def test_gguf_config_survives_the_weight_cache(saved, tmp_path: Path) -> None:
    """A family's config comes back whole from the float32 cache beside its GGUF."""
    path = tmp_path / "phi3.gguf"
    path.write_bytes(saved["phi3"][1].read_bytes())
    source = ModelSource(name="phi3", kind="gguf", path=path)
    cold = load_checkpoint(source)
    warm = load_checkpoint(source)
    assert warm.from_cache and not cold.from_cache
    assert warm.config == cold.config
    assert warm.config.rope_scaling["rope_type"] == "longrope"


def test_unsupported_hf_model_type_lists_the_supported_ones(saved, tmp_path: Path) -> None:
    folder, _, _ = saved["qwen2"]
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "falcon",
                                                      "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="falcon.*qwen2.*qwen3.*mistral.*gemma3.*phi3"):
        load_checkpoint(ModelSource(name="x", kind="hf", path=tmp_path))


def test_unsupported_gguf_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'falcon'.*'qwen2'.*'qwen3'.*'gemma3'.*'phi3'"):
        load_checkpoint(ModelSource(name="x", kind="gguf", path=path), cache=False)


def test_multimodal_gemma3_folder_gives_its_language_model(saved, tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration folder: config under text_config, the
    language model's tensors under model.language_model.*, a vision tower beside."""
    from safetensors.torch import load_file, save_file

    folder, _, _ = saved["gemma3"]
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
         "text_config": text}))
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {"model.language_model." + k[len("model."):]: v for k, v in tensors.items()}
    renamed["model.vision_tower.patch.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    multimodal = load_checkpoint(ModelSource(name="mm", kind="hf", path=tmp_path))
    plain = load_checkpoint(ModelSource(name="text", kind="hf", path=folder))
    assert multimodal.config == plain.config
    assert set(multimodal.weights) == set(plain.weights)
    assert all(torch.equal(multimodal.weights[k], plain.weights[k]) for k in plain.weights)


@pytest.mark.parametrize("qtype, expected", [("F32", None), ("Q4_0", "int4"), ("Q5_0", "int8"),
                                             ("Q8_0", "int8")])
def test_auto_quantization_follows_how_the_file_stores_its_matrices(tmp_path: Path, qtype: str,
                                                                    expected) -> None:
    """"auto" on the CPU: a file's 4-bit blocks run as int4, other quantized blocks
    as int8 from their dequantized weights, float32 matrices stay float."""
    path = tmp_path / f"qwen2-{qtype}.gguf"
    write_gguf(path, reference(transformers, "qwen2"), "qwen2", qtype, tokenizer=True)
    engine = Engine.from_pretrained(str(path), device="cpu", spec="none")
    assert engine.quantization == expected
    out = engine.generate([_prompt(12, 5)], SamplingParams(max_tokens=4, temperature=0.0,
                                                          ignore_eos=True))[0]
    assert len(out.token_ids) == 4
