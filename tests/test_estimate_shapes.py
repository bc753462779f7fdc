"""ModelShape: exact parameter counts of published models, sharding, and argument validation."""

import dataclasses

import pytest

from course_lib.estimate import ModelShape, PRESETS, default_d_ff

# (preset, published count, source). Each count is the checkpoint's own parameter total.
PUBLISHED_COUNTS = [
    ("gpt2-small", 124_439_808, "openai-community/gpt2 checkpoint (tied wte/lm_head); nanoGPT README '124M'"),
    ("gpt2-medium", 354_823_168, "openai-community/gpt2-medium checkpoint"),
    ("gpt2-large", 774_030_080, "openai-community/gpt2-large checkpoint"),
    ("gpt2-xl", 1_557_611_200, "openai-community/gpt2-xl checkpoint"),
    ("llama2-7b", 6_738_415_616, "meta-llama/Llama-2-7b-hf (HF model card: 6.74B)"),
    ("llama2-13b", 13_015_864_320, "meta-llama/Llama-2-13b-hf"),
    ("llama2-70b", 68_976_648_192, "meta-llama/Llama-2-70b-hf (GQA, 8 KV heads)"),
    ("llama3-8b", 8_030_261_248, "meta-llama/Meta-Llama-3-8B (HF model card: 8.03B)"),
    ("llama3-70b", 70_553_706_496, "meta-llama/Meta-Llama-3-70B / Llama-3.1-70B"),
    ("llama3-405b", 405_853_388_800, "meta-llama/Llama-3.1-405B (405.85B)"),
]


@pytest.mark.parametrize("name, expected, source", PUBLISHED_COUNTS, ids=[c[0] for c in PUBLISHED_COUNTS])
def test_preset_matches_published_parameter_count(name, expected, source):
    assert ModelShape.preset(name).num_params() == expected, source


def test_gpt3_matches_rounded_published_count():
    # Brown et al. 2020, Table 2.1 gives only "175.0B". The GPT-2 architecture at that shape
    # (96 x 12288, vocab 50257, context 2048, tied embeddings) has 174.6B, 0.2% below the rounded value.
    n = ModelShape.preset("gpt3-175b").num_params()
    assert n == 174_604_259_328
    assert abs(n - 175.0e9) / 175.0e9 < 0.003


def test_count_equals_narayanan_formula_plus_final_norm():
    # Narayanan et al. 2021, Sec. 5.1, eq. (2): P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), which
    # leaves out the final LayerNorm (2h). Their 1T config (Table 1: "1008.0" B) is l=128, h=25600, V=51200.
    for l, h, a, V, s in [(96, 12288, 96, 51200, 2048), (128, 25600, 160, 51200, 2048), (12, 768, 12, 50257, 1024)]:
        narayanan = 12 * l * h * h + 13 * l * h + (V + s) * h
        assert ModelShape(l, h, a, V, s).num_params() == narayanan + 2 * h
    assert round(ModelShape(128, 25600, 160, 51200, 2048).num_params() / 1e9, 1) == 1008.0


def test_components_add_up_and_tied_head_counts_once():
    shape = ModelShape.preset("llama2-7b")
    parts = shape.embedding_params() + shape.n_layers * shape.layer_params() + shape.head_params()
    assert parts == shape.num_params()
    tied = dataclasses.replace(shape, tied_embeddings=True)
    assert shape.num_params() - tied.num_params() == shape.vocab_size * shape.d_model


def test_default_d_ff():
    assert default_d_ff(768, "gelu") == 3072
    assert default_d_ff(64, "swiglu") == 176  # 8*64/3 = 170.7 -> 176, TinyGPT's rounding
    assert default_d_ff(4096, "swiglu") % 8 == 0


def test_largest_module_is_what_deepspeed_model_to_params_finds():
    # DeepSpeed's model_to_params: max over modules of directly-owned parameters; for GPT-2 the
    # token table (50257 x 768), for Llama 2 7B the 32000 x 4096 table (its MLP matrices are 45M).
    assert ModelShape.preset("gpt2-small").largest_module_params() == 50257 * 768
    assert ModelShape.preset("llama2-7b").largest_module_params() == 32000 * 4096
    assert ModelShape(2, 64, 4, 16, 8).largest_module_params() == 64 * 256 + 256  # the MLP up matrix + bias


def test_busiest_rank_without_parallelism_holds_everything():
    for shape in PRESETS.values():
        assert shape.params_on_busiest_rank() == shape.num_params()


def test_tensor_parallel_replicates_only_norms_and_row_parallel_biases():
    shape = ModelShape.preset("gpt2-small")
    d, L = shape.d_model, shape.n_layers
    replicated = L * (2 * 2 * d + 2 * d) + 2 * d  # two LayerNorms + o/down biases per layer, final norm
    for tp in (2, 4, 12):
        assert tp * shape.params_on_busiest_rank(tp=tp) - shape.num_params() == pytest.approx((tp - 1) * replicated)


def test_pipeline_stages_split_layers_and_ends():
    shape = ModelShape.preset("llama2-7b")  # untied: embedding on the first stage, head on the last
    half = shape.n_layers // 2 * shape.layer_params()
    first = half + shape.embedding_params()
    last = half + shape.head_params()
    assert first + last == shape.num_params()
    assert shape.params_on_busiest_rank(pp=2) == max(first, last)


def test_tinygpt_counts_agree_with_modelshape():
    pytest.importorskip("torch")
    model_mod = pytest.importorskip("course_lib.model")
    cases = [
        ("tiny", {}),
        ("llama-tiny", {}),
        ("tiny", dict(bias=False, tie_embeddings=False, n_kv_heads=2)),
        ("llama-tiny", dict(d_ff=96, n_kv_heads=1)),
    ]
    for preset, overrides in cases:
        cfg = model_mod.ModelConfig.preset(preset, **overrides)
        shape = ModelShape(
            cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size, cfg.block_size, d_ff=cfg.d_ff,
            n_kv_heads=cfg.n_kv_heads, tied_embeddings=cfg.tie_embeddings,
            learned_pos_emb=cfg.position == "learned", bias=cfg.bias, mlp=cfg.mlp, norm=cfg.norm)
        assert shape.num_params() == model_mod.TinyGPT(cfg).num_params(), (preset, overrides)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(n_heads=5), ValueError, ["n_heads", "d_model"]),
    (dict(n_kv_heads=5), ValueError, ["n_kv_heads", "n_heads"]),
    (dict(n_kv_heads=3), ValueError, ["n_kv_heads", "divide"]),
    (dict(n_layers=-1), ValueError, ["n_layers", ">= 1"]),
    (dict(d_model=0), ValueError, ["d_model", ">= 1"]),
    (dict(vocab_size=2.5), TypeError, ["vocab_size", "int"]),
    (dict(n_layers=True), TypeError, ["n_layers", "int"]),
    (dict(mlp="relu"), ValueError, ["mlp", "'gelu'", "'swiglu'"]),
    (dict(norm="batchnorm"), ValueError, ["norm", "'layernorm'"]),
    (dict(bias="yes"), TypeError, ["bias", "bool"]),
    (dict(d_ff=0), ValueError, ["d_ff", ">= 1"]),
])
def test_invalid_shapes_name_the_argument(kwargs, exc, words):
    base = dict(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    with pytest.raises(exc) as info:
        ModelShape(**{**base, **kwargs})
    for word in words:
        assert word in str(info.value)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="name must be one of .*gpt2-small"):
        ModelShape.preset("gpt5")


def test_busiest_rank_rejects_bad_layouts():
    shape = ModelShape.preset("gpt2-small")
    with pytest.raises(ValueError, match=r"tp \(5\) must divide n_heads \(12\)"):
        shape.params_on_busiest_rank(tp=5)
    with pytest.raises(ValueError, match=r"pp \(5\) must divide n_layers \(12\)"):
        shape.params_on_busiest_rank(pp=5)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        shape.params_on_busiest_rank(tp=0)
