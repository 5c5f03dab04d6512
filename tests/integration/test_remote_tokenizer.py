"""The tokenizer endpoints as lm-evaluation-harness's remote tokenizer uses them (its
`lm_eval/utils.py` RemoteTokenizer and check_remote_tokenizer_support, read for this:
GET /tokenizer_info with an `eos_token`, POST /tokenize {"prompt", "add_special_tokens":
false} and POST /detokenize {"tokens"}, none naming a model), against the model's own
tokenizer loaded here."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.conftest import assert_envelope
from tests.serverproc import ServerProcess

TEXTS = ["test", "The quick brown fox jumps over the lazy dog.", "  two spaces\nand a line"]
BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bos_model(tiny_model, tmp_path_factory):
    """The tiny model with a tokenizer that adds a BOS (as Llama's and Gemma's do), so
    that `add_special_tokens` makes a difference."""
    from tokenizers import processors

    path = tmp_path_factory.mktemp("bos") / "tiny-bos"
    shutil.copytree(tiny_model, path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B",
        special_tokens=[(BOS, tok.convert_tokens_to_ids(BOS))])
    tok.bos_token = BOS
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def hf(bos_model):
    tok = AutoTokenizer.from_pretrained(str(bos_model))
    assert tok.encode("test") != tok.encode("test", add_special_tokens=False)
    return tok


@pytest.fixture(scope="module")
def server(bos_model):
    with ServerProcess([str(bos_model)]) as srv:
        srv.wait_healthy()
        yield srv


@pytest.fixture(scope="module")
def model_id(bos_model):
    return str(bos_model)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_harness_finds_the_remote_tokenizer(http, hf, model_id):
    info = http.get("/tokenizer_info")
    assert info.status_code == 200
    body = info.json()
    assert body["eos_token"] == hf.eos_token and body["model"] == model_id
    assert body["chat_template"] == hf.chat_template
    assert body["model_max_length"] == 4096
    probe = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert isinstance(probe.json()["tokens"], list)
    assert http.get("/tokenizer_info", params={"model": model_id}).json() == body


def test_remote_tokens_are_the_models_own(http, hf):
    for text in TEXTS:
        alone = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert alone.json()["tokens"] == hf.encode(text, add_special_tokens=False), text
        default = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert default == hf.encode(text), text
        back = http.post("/detokenize", json={"tokens": alone.json()["tokens"]}).json()
        assert back["prompt"] == hf.decode(hf.encode(text, add_special_tokens=False))
    # The harness's eos_token_id: the first id of its text, tokenized alone.
    eos = http.get("/tokenizer_info").json()["eos_token"]
    ids = http.post("/tokenize", json={"prompt": eos, "add_special_tokens": False})
    assert ids.json()["tokens"][0] == hf.eos_token_id


def test_a_completion_takes_add_special_tokens(client, hf, model_id):
    text = "The quick brown fox"
    with_bos = client.completions.create(model=model_id, prompt=text, max_tokens=1)
    without = client.completions.create(model=model_id, prompt=text, max_tokens=1,
                                        extra_body={"add_special_tokens": False})
    assert with_bos.usage.prompt_tokens == len(hf.encode(text))
    assert without.usage.prompt_tokens == len(hf.encode(text, add_special_tokens=False))


def test_without_a_model_on_a_server_of_several_the_model_is_required(tiny_model,
                                                                      family_model):
    with ServerProcess([str(tiny_model), str(family_model("qwen"))]) as srv:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            assert_envelope(http.post("/tokenize", json={"prompt": "x"}), 400, param="model")
            assert_envelope(http.get("/tokenizer_info"), 400, param="model")
            named = http.get("/tokenizer_info", params={"model": str(family_model("qwen"))})
            assert named.status_code == 200 and "<|im_start|>" in named.json()["chat_template"]
