"""Reference trainer data pipeline: corpus, byte tokenizer, dataset and the resumable sampler."""

from __future__ import annotations

import gzip
import io
from importlib import resources

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.trainer.data import (
    CORPUS_RESOURCE,
    StatefulSampler,
    TokenDataset,
    load_corpus_tokens,
    make_batch,
)
from trainguard.trainer.tokenizer import ByteTokenizer


def drain(sampler: StatefulSampler, steps: int) -> list[list[int]]:
    return [sampler.next_batch_indices() for _ in range(steps)]


# ---------------------------------------------------------------- corpus


def test_corpus_loads_with_expected_size_and_structure() -> None:
    raw = resources.files("trainguard").joinpath(*CORPUS_RESOURCE).read_bytes()
    text = gzip.decompress(raw)
    assert 1_000_000 <= len(text) <= 3_000_000
    assert text.isascii()

    tokens = load_corpus_tokens()
    assert tokens.dtype == torch.int64 and tokens.dim() == 1
    n_docs = text.strip(b"\n").count(b"\n\n") + 1
    assert int((tokens == ByteTokenizer.eos_id).sum()) == n_docs > 1000
    assert int(tokens[-1]) == ByteTokenizer.eos_id
    assert int(tokens.max()) <= ByteTokenizer.eos_id and int(tokens.min()) >= 0
    assert load_corpus_tokens() is tokens  # cached per process


def test_corpus_first_document_round_trips() -> None:
    tokens = load_corpus_tokens()
    first_eos = int((tokens == ByteTokenizer.eos_id).nonzero()[0])
    doc = ByteTokenizer().decode(tokens[:first_eos].tolist())
    assert doc and "\n\n" not in doc and doc.endswith(".")


# ---------------------------------------------------------------- tokenizer


@given(st.text())
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    # Lone surrogates cannot be UTF-8 encoded at all; st.text() avoids them by default.
    assert tok.decode(ids) == text


def test_tokenizer_specials_and_bad_ids() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 259
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (256, 257, 258)
    assert tok.decode([tok.bos_id, *tok.encode("hi"), tok.eos_id, tok.pad_id]) == "hi"
    assert tok.decode([0xFF]) == "\ufffd"
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])


def test_tokenizer_save_and_load(tmp_path) -> None:
    ByteTokenizer().save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "special_tokens_map.json").is_file()
    tok = ByteTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.decode(tok.encode("seven plus five is twelve.")) == "seven plus five is twelve."
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(tmp_path / "hf")  # tokenizer.json: the same ids, for other tools
    for text in ("seven plus five is twelve.", "héllo wörld\n\t日本"):
        assert fast.encode(text, add_special_tokens=False) == tok.encode(text)
        assert fast.decode(tok.encode(text)) == text
    assert fast.convert_tokens_to_ids(["<bos>", "<eos>", "<pad>"]) == [tok.bos_id, tok.eos_id, tok.pad_id]

    cfg = tmp_path / "hf" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"eos_token_id": 257', '"eos_token_id": 2'))
    with pytest.raises(ValueError, match="eos_token_id"):
        ByteTokenizer.from_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        ByteTokenizer.from_pretrained(tmp_path / "missing")


# ---------------------------------------------------------------- dataset


def test_dataset_samples_and_batch() -> None:
    tokens = torch.arange(23)
    ds = TokenDataset(tokens, seq_len=5)
    assert len(ds) == 4  # (23 - 1) // 5
    assert ds[1].tolist() == [5, 6, 7, 8, 9, 10]
    assert ds[3].tolist() == [15, 16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        ds[4]
    inputs, labels = make_batch(ds, [2, 0])
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.tolist() == [[10, 11, 12, 13, 14], [0, 1, 2, 3, 4]]
    assert labels.tolist() == [[11, 12, 13, 14, 15], [1, 2, 3, 4, 5]]
    ds[0][0] = -1  # samples are copies: the corpus is untouched
    assert int(tokens[0]) == 0


def test_dataset_on_corpus() -> None:
    ds = TokenDataset(load_corpus_tokens(), seq_len=256)
    assert len(ds) > 4000
    inputs, labels = make_batch(ds, [0, len(ds) - 1])
    assert inputs.shape == labels.shape == (2, 256)


# ---------------------------------------------------------------- sampler


def test_sampler_deterministic_across_instances() -> None:
    a = StatefulSampler(100, dp_rank=1, dp_size=2, micro_batch_size=3, seed=7)
    b = StatefulSampler(100, dp_rank=1, dp_size=2, micro_batch_size=3, seed=7)
    assert drain(a, 50) == drain(b, 50)
    c = StatefulSampler(100, dp_rank=1, dp_size=2, micro_batch_size=3, seed=8)
    assert drain(c, 5) != drain(StatefulSampler(100, 1, 2, 3, seed=7), 5)


def test_sampler_global_order_is_seeded_randperm() -> None:
    s = StatefulSampler(10, dp_rank=0, dp_size=1, micro_batch_size=4, seed=3)
    expected = (torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
                + torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist())
    assert s.peek_global_indices(0, 20) == expected
    assert s.consumed_samples == 0


def test_sampler_resume_mid_stream(tmp_path) -> None:
    ref = StatefulSampler(37, dp_rank=1, dp_size=3, micro_batch_size=2, seed=11)
    expected = drain(ref, 40)

    first = StatefulSampler(37, dp_rank=1, dp_size=3, micro_batch_size=2, seed=11)
    got = drain(first, 17)
    torch.save(first.state_dict(), tmp_path / "sampler.pt")
    state = torch.load(tmp_path / "sampler.pt", weights_only=True)
    assert state == {"consumed_samples": 17 * 6, "seed": 11, "skipped": []}

    resumed = StatefulSampler(37, dp_rank=1, dp_size=3, micro_batch_size=2, seed=0)
    resumed.load_state_dict(state)  # the saved seed wins
    got += drain(resumed, 23)
    assert got == expected


def test_sampler_rejects_bad_state() -> None:
    s = StatefulSampler(10, 0, 1, 1, seed=0)
    with pytest.raises(KeyError):
        s.load_state_dict({"seed": 0})
    with pytest.raises(TypeError):
        s.load_state_dict({"consumed_samples": torch.tensor(3), "seed": 0})
    with pytest.raises(ValueError):
        s.load_state_dict({"consumed_samples": -1, "seed": 0})


@settings(max_examples=60, deadline=None)
@given(
    dataset_len=st.integers(1, 60),
    dp_size=st.integers(1, 6),
    mbs=st.integers(1, 5),
    seed=st.integers(0, 2**31),
    steps=st.integers(1, 12),
)
def test_sampler_sharding_splits_each_global_window(dataset_len: int, dp_size: int, mbs: int, seed: int,
                                                    steps: int) -> None:
    ranks = [StatefulSampler(dataset_len, r, dp_size, mbs, seed) for r in range(dp_size)]
    oracle = StatefulSampler(dataset_len, 0, 1, 1, seed)
    gbs = dp_size * mbs
    for step in range(steps):
        per_rank = [s.next_batch_indices() for s in ranks]
        assert all(len(ix) == mbs for ix in per_rank)
        window = oracle.peek_global_indices(step * gbs, gbs)
        assert [i for ix in per_rank for i in ix] == window  # contiguous split, in rank order
        if (step * gbs) // dataset_len == (step * gbs + gbs - 1) // dataset_len:
            # Within one epoch the window is part of a permutation, so ranks are disjoint.
            flat = [i for ix in per_rank for i in ix]
            assert len(set(flat)) == len(flat)
            assert set(flat) == set(window)


def test_sampler_changes_dp_size_without_repeating_or_skipping() -> None:
    n, mbs, seed = 50, 3, 5
    two = [StatefulSampler(n, r, 2, mbs, seed) for r in range(2)]
    seen: list[int] = []
    for _ in range(4):
        for s in two:
            seen += s.next_batch_indices()
    state = two[0].state_dict()
    assert state == two[1].state_dict()  # every rank holds the same global position

    one = StatefulSampler(n, 0, 1, mbs, seed)
    one.load_state_dict(state)
    for _ in range(10):
        seen += one.next_batch_indices()

    assert seen == one.peek_global_indices(0, len(seen))
    assert len(seen) == 54
    assert sorted(seen[:n]) == list(range(n))  # first epoch: every sample exactly once


def test_sampler_epoch_wrap() -> None:
    n = 10
    s = StatefulSampler(n, dp_rank=0, dp_size=1, micro_batch_size=4, seed=1)
    seen = [i for batch in drain(s, 5) for i in batch]  # 20 positions: exactly two epochs
    assert s.epoch == 2
    assert sorted(seen[:n]) == list(range(n)) and sorted(seen[n:]) == list(range(n))
    assert seen[:n] != seen[n:]  # each epoch reshuffles
    # The third batch straddles the boundary: positions 8, 9 of epoch 0 and 0, 1 of epoch 1.
    batch3 = StatefulSampler(n, 0, 1, 4, seed=1).peek_global_indices(8, 4)
    assert batch3 == seen[8:12]


def test_sampler_validates_arguments() -> None:
    with pytest.raises(ValueError):
        StatefulSampler(0, 0, 1, 1, 0)
    with pytest.raises(ValueError):
        StatefulSampler(10, 2, 2, 1, 0)
    with pytest.raises(ValueError):
        StatefulSampler(10, 0, 1, 0, 0)


def test_sampler_state_is_weights_only_loadable() -> None:
    s = StatefulSampler(10, 0, 1, 2, seed=4)
    drain(s, 3)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == {"consumed_samples": 6, "seed": 4, "skipped": []}
