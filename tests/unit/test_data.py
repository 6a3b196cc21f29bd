import pytest
import torch

from parallel.core.data import DataError, GlobalBatches, load_corpus, local_microbatches, stdlib_source_dir


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None, 1 << 20, 33)


def test_default_corpus_is_the_standard_library(corpus):
    assert corpus.dtype == torch.uint8 and corpus.numel() == 1 << 20
    assert "site-packages" not in str(stdlib_source_dir())
    assert (stdlib_source_dir() / "os.py").exists()


def test_step_batch_is_deterministic_and_differs_between_steps(corpus):
    a = GlobalBatches(corpus, 32, 16, seed=1)
    b = GlobalBatches(corpus, 32, 16, seed=1)
    assert torch.equal(a(5).inputs, b(5).inputs)
    assert not torch.equal(a(5).inputs, a(6).inputs)
    assert not torch.equal(a(5).inputs, GlobalBatches(corpus, 32, 16, seed=2)(5).inputs)
    batch = a(0)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])  # targets are inputs shifted by one


@pytest.mark.parametrize("dp,micro", [(1, 1), (2, 1), (4, 2), (8, 2), (2, 8)])
def test_every_topology_sees_the_same_global_batch(corpus, dp, micro):
    batches = GlobalBatches(corpus, 32, 16, seed=7)
    for step in range(3):
        glob = batches(step)
        pieces = [mb for rank in range(dp) for mb in local_microbatches(glob, rank, dp, micro)]
        assert len(pieces) == dp * micro
        assert all(mb.n_sequences == 16 // (dp * micro) for mb in pieces)
        assert torch.equal(torch.cat([mb.inputs for mb in pieces]), glob.inputs)
        assert torch.equal(torch.cat([mb.targets for mb in pieces]), glob.targets)


def test_checksum_tracks_content(corpus):
    batches = GlobalBatches(corpus, 32, 4, seed=0)
    assert batches(0).checksum() == batches(0).checksum() != batches(1).checksum()


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"does not exist: point data.path at a text file"):
        load_corpus(str(tmp_path / "nope"), 1000, 33)


def test_empty_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"is empty"):
        load_corpus(str(tmp_path / "empty.txt"), 1000, 33)


def test_binary_file(tmp_path):
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DataError, match=r"is a binary file"):
        load_corpus(str(tmp_path / "blob.txt"), 1000, 33)


def test_directory_without_text(tmp_path):
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match=r"holds no text files"):
        load_corpus(str(tmp_path), 1000, 33)


def test_corpus_shorter_than_a_sequence(tmp_path):
    (tmp_path / "short.txt").write_text("hello")
    with pytest.raises(DataError, match=r"has 5 bytes of text, fewer than one training sequence needs \(33"):
        load_corpus(str(tmp_path / "short.txt"), 1000, 33)


def test_directory_skips_binary_files_and_reads_text(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\x00binary")
    (tmp_path / "b.txt").write_text("x" * 100)
    assert load_corpus(str(tmp_path), 1000, 33).numel() == 100
