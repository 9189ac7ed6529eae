"""The embeddings writer: rows committed batch by batch into OUTPUT.partial, an interrupted file resumed with
the same fingerprint (only the missing rows redone), a changed job refused, the finished file renamed into place;
the input reader's rules (text or tokens, empty texts, truncation) and length bucketing."""

import numpy as np
import pytest

from hpcinfer.arch import ModelArch
from hpcinfer.embed.inputs import EmbedInput, load_inputs
from hpcinfer.embed.job import bucket_batches
from hpcinfer.embed.output import EmbeddingWriter, read_embeddings
from hpcinfer.errors import ConfigError, InputError

ARCH = ModelArch(family="bert", vocab_size=50, hidden_size=4, num_layers=1, num_heads=1, num_kv_heads=1,
                 head_dim=4, intermediate_size=8, max_positions=16, causal=False, norm_position="post")
INPUTS = [EmbedInput(f"i{n}", list(range(1, n + 2)), n + 1) for n in range(4)]


def fp(value):
    return {"digest": f"sha256:{value}", "parts": {"config": {"embed.pooling": value}}}


def rows(indices):
    return [np.full(4, i, np.float32) for i in indices]


def test_interrupted_output_resumes_only_the_missing_rows(tmp_path):
    path = str(tmp_path / "e.h5")
    w = EmbeddingWriter(path, INPUTS, ARCH, "mean", True, 16, fp("a"))
    assert not w.start().any()
    w.write_rows([2, 0], rows([2, 0]))
    w.close()                                                      # interrupted: no OUTPUT, a partial file
    assert not (tmp_path / "e.h5").exists() and (tmp_path / "e.h5.partial").exists()
    with pytest.raises(ConfigError, match="embed.pooling"):      # a changed job is refused, naming the change
        EmbeddingWriter(path, INPUTS, ARCH, "mean", True, 16, fp("b")).start()
    w = EmbeddingWriter(path, INPUTS, ARCH, "mean", True, 16, fp("a"))
    assert w.start().tolist() == [True, False, True, False]
    w.write_rows([3, 1], rows([3, 1]))
    w.finish()
    out = read_embeddings(path)
    assert out["ids"] == ["i0", "i1", "i2", "i3"] and out["embeddings"][:, 0].tolist() == [0, 1, 2, 3]
    assert out["lengths"].tolist() == [1, 2, 3, 4] and out["attrs"]["pooling"] == "mean"
    again = EmbeddingWriter(path, INPUTS, ARCH, "mean", True, 16, fp("a"))
    assert again.start().all()                                     # complete: nothing to redo
    assert not EmbeddingWriter(path, INPUTS, ARCH, "mean", True, 16, fp("b"), restart=True).start().any()


def test_a_missing_row_fails_the_finish(tmp_path):
    w = EmbeddingWriter(str(tmp_path / "e.h5"), INPUTS, ARCH, "none", False, 16)
    w.start()
    w.write_rows([0, 1, 2], [np.ones((len(INPUTS[i].tokens), 4), np.float32) for i in range(3)])
    with pytest.raises(RuntimeError, match="1 embeddings were never written"):
        w.finish()


def test_bucketing_sorts_by_length_and_keeps_every_input():
    lengths = [5, 1, 9, 1, 3, 7]
    batches = bucket_batches(lengths, 4)
    assert batches == [[1, 3, 4, 0], [5, 2]]


@pytest.mark.parametrize("line, message", [
    ('{"id": 1}', 'exactly one of "text" and "tokens"'),
    ('{"id": 1, "text": "a", "tokens": [1]}', 'exactly one of "text" and "tokens"'),
    ('{"id": 1, "tokens": []}', "has no tokens"),
    ('{"id": 1, "tokens": [99]}', "outside the vocabulary"),
    ('{"id": 1, "text": "hello"}', "needs a tokenizer"),
    ('{"id": 1, "tokens": [1, 2], "chat": true}', "unknown key 'chat'"),
    ('{"id": 1, "tokens": [1,2,3,4,5,6,7,8,9]}', "more than [embed] max_length = 8"),
])
def test_bad_input_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 0, "tokens": [1, 2]}\n' + line + "\n")
    with pytest.raises(InputError) as err:
        load_inputs(str(path), ARCH, None, 8, truncate=False)
    assert f"{path}:2:" in str(err.value) and message in str(err.value)


def test_token_inputs_truncate_when_allowed(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "tokens": [1,2,3,4,5,6,7,8,9]}\n')
    (item,) = load_inputs(str(path), ARCH, None, 8, truncate=True)
    assert item.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and item.truncated


class OneRank:
    """The world and mesh of a single rank, as run_rounds sees them."""
    coords = (0, 0, 0)
    shape = type("Shape", (), {"dp": 1, "tp": 1})()

    def gather(self, value, root=0):
        return [value]

    def bcast(self, value, root=0):
        return value


def test_a_signal_stops_after_the_round_in_flight(tmp_path):
    from types import SimpleNamespace

    from encoder_models import save_tiny_encoder
    from hpcinfer.checkpoint.hf import convert_hf
    from hpcinfer.embed.api import load_encoder
    from hpcinfer.embed.job import EmbedJob, run_rounds
    from hpcinfer.generate.rounds import StopFlag

    convert_hf(save_tiny_encoder("distilbert", tmp_path / "hf"), str(tmp_path / "m.h5"))
    model, _ = load_encoder(str(tmp_path / "m.h5"))
    inputs = [EmbedInput(f"i{n}", [2] + list(range(10, 10 + n)) + [3], n + 1) for n in range(5)]
    config = SimpleNamespace(embed=SimpleNamespace(pooling="mean", normalize=True))
    job = EmbedJob(config, None, inputs, 16, bucket_batches([len(x.tokens) for x in inputs], 2))
    writer = EmbeddingWriter(str(tmp_path / "e.h5"), inputs, model.arch, "mean", True, 16, fp("a"))
    stop = StopFlag()
    stop.reason = "SIGUSR1"                                        # as the handler sets it
    stats = run_rounds(OneRank(), OneRank(), model, job, writer, stop)
    writer.close()
    assert stats.stopped == "SIGUSR1 on rank 0" and stats.batches == 1
    resumed = EmbeddingWriter(str(tmp_path / "e.h5"), inputs, model.arch, "mean", True, 16, fp("a"))
    assert resumed.start().tolist() == [True, True, False, False, False]
    stats = run_rounds(OneRank(), OneRank(), model, job, resumed, StopFlag())
    resumed.finish()
    assert stats.stopped is None and stats.batches == 2
    assert np.allclose(np.linalg.norm(read_embeddings(str(tmp_path / "e.h5"))["embeddings"], axis=1), 1.0)


def test_a_text_cut_below_its_special_tokens_is_cut_plainly(tmp_path):
    """max_length = 1 is below [CLS] + [SEP]: the tokenizer would not truncate at all; the input is cut to 1."""
    from encoder_models import _tokenizer
    from hpcinfer.embed.inputs import EncoderTokenizer

    tokenizer = EncoderTokenizer(_tokenizer("bert", 200).to_str())
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "text": "hello world there"}\n{"id": "b", "text": "x y"}\n')
    arch = ModelArch(**{**ARCH.__dict__, "vocab_size": 200})
    for n in (1, 2, 3):
        items = load_inputs(str(path), arch, tokenizer, n, truncate=True)
        assert all(len(x.tokens) <= n and x.truncated for x in items)
        assert items[0].tokens[0] == 2 and (n < 2 or items[0].tokens[-1] == 3)    # [CLS] ... [SEP] from 2 on
