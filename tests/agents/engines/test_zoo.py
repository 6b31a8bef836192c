"""Model zoo: deterministic weights and their hash, fingerprints, refusal of a wrong hash."""

from __future__ import annotations

import json
import shutil

import pytest

from agents.engines.reference import zoo


def test_same_seed_gives_same_weight_bytes(tmp_path):
    a = zoo.build_weights("gemma3", tmp_path / "a", seed=5)
    b = zoo.build_weights("gemma3", tmp_path / "b", seed=5)
    c = zoo.build_weights("gemma3", tmp_path / "c", seed=6)

    assert a == b != c
    assert a == zoo.file_sha256(tmp_path / "a" / zoo.WEIGHTS_FILE)
    assert json.loads((tmp_path / "a" / zoo.META_FILE).read_text())["weights_sha256"] == a


def test_linear_decay_drawn_from_sensitive_range(models_dir):
    lm = zoo.load_model(zoo.resolve_model("qwen3-next", models_dir), name="q")
    decays = [p.detach().exp() for n, p in lm.model.named_parameters() if n.endswith("A_log")]

    assert len(decays) == 3
    assert all(float(d.min()) >= 0.001 and float(d.max()) <= 0.05 for d in decays)
    assert lm.model.config.initializer_range == 0.1


def test_fingerprint_depends_on_dtype_and_architecture(models_dir):
    q32 = zoo.load_model(zoo.resolve_model("qwen3-next", models_dir), name="q")
    q16 = zoo.load_model(zoo.resolve_model("qwen3-next", models_dir), name="q", dtype="bfloat16")
    g32 = zoo.load_model(zoo.resolve_model("gemma3", models_dir), name="g")

    assert q32.weights_sha256 == q16.weights_sha256
    assert len({q32.fingerprint, q16.fingerprint, g32.fingerprint}) == 3


def test_wrong_expected_hash_is_refused(models_dir):
    path = zoo.resolve_model("dense", models_dir)

    with pytest.raises(zoo.ModelError, match="expect_sha256"):
        zoo.load_model(path, name="d", expect_sha256="f" * 64)


def test_unknown_model_and_dtype_named(models_dir):
    with pytest.raises(
        zoo.ModelError, match="neither a checkpoint directory nor a zoo architecture"
    ):
        zoo.resolve_model("llama-70b", models_dir)
    with pytest.raises(zoo.ModelError, match="dtype"):
        zoo.load_model(zoo.resolve_model("dense", models_dir), name="d", dtype="int8")


def test_byte_tokenizer_roundtrip():
    tok = zoo.ByteTokenizer()

    ids = tok.encode("héllo")
    assert ids[0] == tok.BOS
    assert tok.decode(ids) == "héllo"


def test_checkpoint_directory_needs_one_weights_file(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"y")

    with pytest.raises(zoo.ModelError, match=r"exactly one \.gguf"):
        zoo.load_model(tmp_path, name="x")


def test_checkpoint_directory_without_tokenizer_or_with_a_broken_config_is_named(
    models_dir, tmp_path
):
    """A local checkpoint directory (real weights) brings its own tokenizer; without one, or
    with a config transformers cannot read, loading fails naming the directory, not with a
    traceback from inside transformers."""
    built = zoo.resolve_model("dense", models_dir)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", zoo.WEIGHTS_FILE):
        shutil.copy(built / name, bare / name)
    broken = tmp_path / "broken"
    shutil.copytree(bare, broken)
    (broken / "config.json").write_text('{"model_type": "no-such-model"}')

    with pytest.raises(zoo.ModelError, match=r"bare has no tokenizer.*\(tokenizer\.json"):
        zoo.load_model(bare, name="x")
    with pytest.raises(zoo.ModelError, match=r"broken cannot be loaded as a causal LM"):
        zoo.load_model(broken, name="x")
