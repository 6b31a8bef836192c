import pytest

from console.planner.kvsize import (
    ArchitectureError,
    architecture_hash,
    dense_equivalent,
    kv_bytes,
    kv_size,
    validate_architecture,
)

DENSE = {
    "dtype_bytes": 2,
    "layers": [{"kind": "full", "count": 32, "kv_heads": 8, "head_dim": 128}],
}


def test_dense_gqa_formula():
    # 2 x layers x kv_heads x head_dim x bytes x l
    assert kv_bytes(DENSE, 1000) == 2 * 32 * 8 * 128 * 2 * 1000


def test_mla_per_token_is_latent_plus_rope():
    arch = {
        "dtype_bytes": 2,
        "layers": [{"kind": "mla", "count": 10, "kv_lora_rank": 512, "rope_head_dim": 64}],
    }

    assert kv_bytes(arch, 100) == 10 * (512 + 64) * 2 * 100


def test_sliding_window_stops_growing_at_the_window():
    arch = {
        "dtype_bytes": 2,
        "layers": [{"kind": "sliding", "count": 5, "window": 128, "kv_heads": 4, "head_dim": 64}],
    }

    assert kv_bytes(arch, 100) == 5 * 2 * 4 * 64 * 2 * 100
    assert kv_bytes(arch, 128) == kv_bytes(arch, 100_000)


def test_linear_state_is_independent_of_length_and_keeps_its_own_dtype():
    arch = {
        "dtype_bytes": 2,
        "state_dtype_bytes": 4,
        "layers": [
            {
                "kind": "linear",
                "count": 3,
                "num_heads": 16,
                "key_head_dim": 128,
                "value_head_dim": 128,
                "conv_dim": 8192,
                "conv_kernel": 4,
            }
        ],
    }

    size = kv_size(arch, 50_000)

    assert size.fixed_bytes == 3 * (16 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert size.per_token_bytes == 0
    assert size.total_bytes == kv_bytes(arch, 1)


def test_hybrid_3_to_1_is_several_times_smaller_than_its_dense_equivalent_at_32k():
    hybrid = {
        "dtype_bytes": 2,
        "state_dtype_bytes": 4,
        "layers": [
            {"kind": "full", "count": 12, "kv_heads": 8, "head_dim": 128},
            {
                "kind": "linear",
                "count": 36,
                "num_heads": 16,
                "key_head_dim": 128,
                "value_head_dim": 128,
            },
        ],
    }

    ratio = kv_bytes(dense_equivalent(hybrid), 32_768) / kv_bytes(hybrid, 32_768)

    assert 3.5 < ratio < 4.0  # 48/12 = 4x fewer per-token bytes, minus the fixed state


@pytest.mark.parametrize(
    ("arch", "field"),
    [
        ([], "architecture"),
        ({"layers": []}, "layers"),
        ({"layers": [{"kind": "moe"}]}, "layers[0].kind"),
        ({"layers": [{"kind": "full", "kv_heads": 8}]}, "layers[0].head_dim"),
        ({"layers": [{"kind": "full", "kv_heads": 8, "head_dim": -1}]}, "layers[0].head_dim"),
        (
            {"layers": [{"kind": "full", "kv_heads": 8, "head_dim": 64, "window": 3}]},
            "layers[0].window",
        ),
        (
            {"dtype_bytes": "2", "layers": [{"kind": "conv", "conv_dim": 8, "conv_kernel": 3}]},
            "dtype_bytes",
        ),
        (
            {
                "layers": [
                    {"kind": "sliding", "count": True, "window": 2, "kv_heads": 1, "head_dim": 1}
                ]
            },
            "layers[0].count",
        ),
    ],
)
def test_invalid_architectures_name_the_field(arch, field):
    with pytest.raises(ArchitectureError) as excinfo:
        validate_architecture(arch)

    assert excinfo.value.field == field


def test_architecture_hash_is_stable_under_key_order_and_defaults():
    a = {"layers": [{"kind": "full", "kv_heads": 8, "head_dim": 128}]}
    b = {"dtype_bytes": 2, "layers": [{"head_dim": 128, "count": 1, "kind": "full", "kv_heads": 8}]}

    assert architecture_hash(a) == architecture_hash(b)
    assert architecture_hash(a) != architecture_hash(DENSE)


# --- explicit per-layer lists ----------------------------------------------------------------

# Qwen3-Next style: every fourth layer is full attention, the others linear (12 layers).
LINEAR = {"kind": "linear", "num_heads": 4, "key_head_dim": 8, "value_head_dim": 8}
FULL = {"kind": "full", "kv_heads": 2, "head_dim": 16}


def test_per_layer_indices_size_like_counts_and_keep_the_order():
    by_count = {"layers": [{**FULL, "count": 3}, {**LINEAR, "count": 9}]}
    by_index = {
        "layers": [
            {**LINEAR, "indices": [0, 1, 2, 4, 5, 6, 8, 9, 10]},
            {**FULL, "indices": [11, 3, 7]},
        ]
    }

    normalised = validate_architecture(by_index)

    assert [g["count"] for g in normalised["layers"]] == [9, 3]
    assert normalised["layers"][1]["indices"] == [3, 7, 11]
    for tokens in (0, 1000, 32768):
        assert kv_size(by_index, tokens) == kv_size(by_count, tokens)
    # Where the layers sit is part of the model's identity (the KV manifest follows it).
    moved = {
        "layers": [
            {**LINEAR, "indices": [1, 2, 3, 4, 5, 6, 8, 9, 10]},
            {**FULL, "indices": [0, 7, 11]},
        ]
    }
    assert architecture_hash(moved) != architecture_hash(by_index)
    assert architecture_hash(by_count) != architecture_hash(by_index)


@pytest.mark.parametrize(
    ("layers", "field", "fragment"),
    [
        ([{**FULL, "indices": []}], "layers[0].indices", "non-empty"),
        ([{**FULL, "indices": "0,1"}], "layers[0].indices", "non-empty"),
        ([{**FULL, "indices": [0, -1]}], "layers[0].indices[1]", ">= 0"),
        ([{**FULL, "indices": [0, 1.5]}], "layers[0].indices[1]", "integer"),
        ([{**FULL, "indices": [0, 0]}], "layers[0].indices", "twice"),
        ([{**FULL, "indices": [0, 1], "count": 3}], "layers[0].count", "lists 2"),
        ([{**FULL, "indices": [0]}, {**LINEAR, "count": 2}], "layers[1].indices", "every"),
        (
            [{**FULL, "indices": [0, 1]}, {**LINEAR, "indices": [1]}],
            "layers[1].indices",
            "layers[0]",
        ),
        ([{**FULL, "indices": [0, 1]}, {**LINEAR, "indices": [3]}], "layers", "2 is missing"),
    ],
)
def test_bad_per_layer_indices_name_the_field(layers, field, fragment):
    with pytest.raises(ArchitectureError) as excinfo:
        validate_architecture({"layers": layers})

    assert excinfo.value.field == field
    assert fragment in excinfo.value.message
