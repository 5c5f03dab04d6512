"""Embedding and reranker engines (worker/pooling/), in this process: pooling exactly as
the model's configuration says, batches that equal single runs, Matryoshka truncation,
the LM reranker's yes/no score, and the refusals of what a request cannot have."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from protocol.messages import (CONTEXT_LENGTH_EXCEEDED, Generate, ModelKind, Task,
                               pack_ids)
from protocol.models import model_kind
from worker.loading.models import read_config
from worker.pooling import pooling_config
from worker.pooling.embedder import EmbedEngine
from worker.pooling.jobs import TOKENS_PER_STEP, Job
from worker.pooling.reranker import LMReranker
from worker.errors import RequestError
from worker.text.tokens import Answered

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 3, "a",
         "def main():\n    print('hello')\n"]


def run_job(engine, gen) -> np.ndarray:
    job = engine.prepare(gen)
    while not job.finished:
        batch = job.next_batch()
        job.store(batch, engine.run(*job.batch(batch)))
    return engine.finish(job)


@pytest.fixture(scope="module")
def bert(embed_model):
    path = embed_model("bert")
    return EmbedEngine.load(path, read_config(path), 512)


@pytest.fixture(scope="module")
def qwen3(embed_model):
    path = embed_model("qwen3")
    return EmbedEngine.load(path, read_config(path), 1024)


def embed(**kw) -> Generate:
    return Generate(rid="r", task=Task.EMBED, **kw)


@pytest.mark.parametrize("preset", ["bert", "qwen3"])
def test_a_batch_equals_each_input_alone_and_rows_are_unit_vectors(request, preset):
    engine = request.getfixturevalue(preset)
    together = run_job(engine, embed(inputs=TEXTS))
    alone = np.stack([run_job(engine, embed(inputs=[t]))[0] for t in TEXTS])
    assert together.shape == (len(TEXTS), engine.dim)
    np.testing.assert_allclose(together, alone, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    # Different texts, different vectors (padding did not make rows alike).
    assert np.abs(together[0] - together[1]).max() > 1e-3


def test_pooling_follows_the_sentence_transformers_config(bert, qwen3):
    """BERT: mean over the real tokens, CLS and SEP included; Qwen3: the last token."""
    assert bert.pooling.mode == "mean" and qwen3.pooling.mode == "lasttoken"
    for engine in (bert, qwen3):
        ids = engine.tokenizer.encode(TEXTS[0], add_special_tokens=True)
        out = engine.model(mx.array([ids]), attention_mask=mx.ones((1, len(ids)), mx.int32))
        hidden = np.array(out.last_hidden_state[0].astype(mx.float32))
        want = hidden.mean(axis=0) if engine is bert else hidden[-1]
        want = want / np.linalg.norm(want)
        np.testing.assert_allclose(run_job(engine, embed(inputs=[TEXTS[0]]))[0], want,
                                   atol=1e-5)


def test_token_id_inputs_embed_like_their_text(bert):
    ids = bert.tokenizer.encode(TEXTS[1], add_special_tokens=True)
    by_ids = run_job(bert, embed(input_ids=[pack_ids(ids)]))
    np.testing.assert_allclose(by_ids, run_job(bert, embed(inputs=[TEXTS[1]])), atol=1e-6)


def test_dimensions_keep_the_leading_values_renormalised(bert, qwen3):
    full = run_job(bert, embed(inputs=TEXTS))
    short = run_job(bert, embed(inputs=TEXTS, dimensions=16))
    want = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, want, atol=1e-6)
    with pytest.raises(RequestError, match="one of 16, 32, 64") as e:
        bert.prepare(embed(inputs=["a"], dimensions=20))
    assert e.value.param == "dimensions"
    with pytest.raises(RequestError, match="Matryoshka"):  # not trained for it
        qwen3.prepare(embed(inputs=["a"], dimensions=16))


def test_what_an_embedding_request_cannot_have_is_refused(bert):
    with pytest.raises(RequestError) as e:
        bert.prepare(embed(inputs=["word " * 600]))
    assert e.value.code == CONTEXT_LENGTH_EXCEEDED and "input[0]" in e.value.message
    with pytest.raises(RequestError, match="out of range"):
        bert.prepare(embed(input_ids=[pack_ids([bert.vocab_size])]))
    with pytest.raises(RequestError, match="embedding model: it cannot generate"):
        bert.prepare(Generate(rid="r", messages=[{"role": "user", "content": "hi"}]))
    with pytest.raises(RequestError, match="cannot rerank"):
        bert.prepare(Generate(rid="r", task=Task.SCORE, prompt="q", inputs=["d"]))


def test_an_embedding_model_tokenizes_and_detokenizes(bert):
    answered = bert.prepare(Generate(rid="r", task=Task.TOKENIZE, prompt="hello world"))
    assert isinstance(answered, Answered)
    assert answered.ids == bert.tokenizer.encode("hello world", add_special_tokens=True)
    back = bert.prepare(Generate(rid="r", task=Task.DETOKENIZE,
                                 prompt_ids=pack_ids(answered.ids[1:-1])))
    assert back.text == "hello world"


def test_batches_stay_within_the_step_limits_and_cover_every_input_once():
    rows = [[1] * n for n in (5, 3000, 7, 4000, 1, 2000, 9) * 20]
    job = Job(None, rows, 1)
    seen = []
    while not job.finished:
        batch = job.next_batch()
        assert batch
        longest = max(len(rows[i]) for i in batch)
        assert len(batch) == 1 or longest * len(batch) <= TOKENS_PER_STEP
        seen += batch
    assert sorted(seen) == list(range(len(rows)))


def test_pooling_config_refuses_a_pipeline_it_cannot_run(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(pooling_config.PoolingConfigError, match="Dense"):
        pooling_config.read(tmp_path, {})
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}))
    with pytest.raises(pooling_config.PoolingConfigError, match="pooling mode"):
        pooling_config.read(tmp_path, {})
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True}))
    got = pooling_config.read(tmp_path, {"is_matryoshka": True})
    assert got == pooling_config.Pooling("cls", False, ())


def test_model_kind_by_files_and_name(tmp_path, embed_model, reranker_model, tiny_model):
    assert model_kind(embed_model("bert"), read_config(embed_model("bert"))) is ModelKind.EMBED
    assert model_kind(reranker_model, {}) is ModelKind.RERANK
    assert model_kind(tiny_model, read_config(tiny_model)) is ModelKind.TEXT
    assert model_kind(tmp_path, {"architectures": ["XLMRobertaForSequenceClassification"]}
                      ) is ModelKind.RERANK
    assert model_kind(tmp_path, {"model_type": "bert"}) is ModelKind.EMBED
    snapshot = tmp_path / "models--Qwen--Qwen3-Embedding-0.6B" / "snapshots" / "abc"
    assert model_kind(snapshot, {"model_type": "qwen3"}) is ModelKind.EMBED


@pytest.fixture(scope="module")
def reranker(reranker_model):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(reranker_model))
    return LMReranker(model, tokenizer, 4096, len(tokenizer))


def test_rerank_score_is_p_yes_over_no_and_batches_equal_single_runs(reranker):
    docs = ["mlx is an array framework", "bananas are long and yellow", "x", TEXTS[1]]
    gen = Generate(rid="r", task=Task.SCORE, prompt="what is mlx", inputs=docs)
    together = run_job(reranker, gen)[:, 0]
    alone = [run_job(reranker, Generate(rid="r", task=Task.SCORE, prompt="what is mlx",
                                        inputs=[d]))[0, 0] for d in docs]
    np.testing.assert_allclose(together, alone, atol=1e-5)
    ids = reranker._pair("what is mlx", docs[0])
    logits = reranker.model(mx.array([ids]))[0, -1].astype(mx.float32)
    no, yes = float(logits[reranker.no]), float(logits[reranker.yes])
    assert together[0] == pytest.approx(1 / (1 + np.exp(no - yes)), abs=1e-5)
    assert ((together > 0) & (together < 1)).all()


@pytest.mark.parametrize("preset", ["xlm-roberta", "bert"])
def test_a_cross_encoder_scores_with_its_checkpoints_head(cross_encoder_model, preset):
    """The head is read from the checkpoint's own `classifier.*` (and BERT's pooler)
    weights, as transformers saved them: recomputed here by hand from the file."""
    from protocol.models import context_length
    from worker.pooling.cross_encoder import CrossEncoder

    path = cross_encoder_model(preset)
    config = read_config(path)
    engine = CrossEncoder.load(path, config, context_length(config))
    assert engine.context_length == 512  # XLM-R: 514 positions, two never usable
    docs = ["mlx is an array framework", "bananas", "word " * 700]
    gen = Generate(rid="r", task=Task.SCORE, prompt="what is mlx", inputs=docs)
    job = engine.prepare(gen)
    assert len(job.rows[2]) == 512  # the long document is cut to fit, the query kept
    together = run_job(engine, gen)[:, 0]
    alone = [run_job(engine, Generate(rid="r", task=Task.SCORE, prompt="what is mlx",
                                      inputs=[d]))[0, 0] for d in docs]
    np.testing.assert_allclose(together, alone, atol=1e-5)

    w = mx.load(str(path / "model.safetensors"))
    enc = engine.tokenizer("what is mlx", docs[0], return_token_type_ids=preset == "bert")
    kwargs = ({"token_type_ids": mx.array([enc["token_type_ids"]])} if preset == "bert"
              else {})
    if preset == "bert":
        assert set(enc["token_type_ids"]) == {0, 1}  # the document is the second segment
    out = engine.encoder(mx.array([enc["input_ids"]]), **kwargs)
    first = out.last_hidden_state[0, 0]
    if preset == "bert":
        pooled = mx.tanh(w["bert.pooler.dense.weight"] @ first + w["bert.pooler.dense.bias"])
        logit = w["classifier.weight"] @ pooled + w["classifier.bias"]
    else:
        h = mx.tanh(w["classifier.dense.weight"] @ first + w["classifier.dense.bias"])
        logit = w["classifier.out_proj.weight"] @ h + w["classifier.out_proj.bias"]
    assert together[0] == pytest.approx(float(mx.sigmoid(logit)[0]), abs=1e-5)
