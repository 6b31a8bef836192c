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
