"""A vision model served end to end (worker/vision/, supervisor/api/fields/media.py): the
real supervisor and worker over HTTP with the official openai client, on the tiny
random-weight Qwen2-VL. Random weights: asserts on structure, not on words. Audio, which
no checkpoint here reads, is a 400 on every surface."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from tests.serverproc import ServerProcess


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def vserver(vision_model, media_dir):
    # --stream-interval 0: every token its own chunk (real streaming, not one emulated
    # chunk, whatever the machine's speed)
    with ServerProcess([str(vision_model)], "--stream-interval", "0",
                       "--allowed-media-dir", str(media_dir)) as srv:
        srv.wait_healthy(timeout=120)
        yield srv


@pytest.fixture
def vclient(vserver):
    return openai.OpenAI(base_url=f"{vserver.url}/v1", api_key="x", max_retries=0)


def data_url(w=40, h=40, seed=0, fmt="PNG") -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def ask(url, text="What is in the picture?"):
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_the_model_is_listed_as_a_vision_model(vclient, vision_model):
    assert vclient.models.retrieve(str(vision_model)).model_extra["kind"] == "vision"


def test_image_chat_streams_tokens_and_equals_the_non_streamed_answer(vclient, vision_model):
    model = str(vision_model)
    r = vclient.chat.completions.create(model=model, messages=ask(data_url()), max_tokens=8,
                                        temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    # the image's tokens count as prompt tokens: more than the text alone
    text_only = vclient.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is in the picture?"}],
        max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens
    # Streamed: the same answer in several chunks (the worker sends one per token,
    # tests/worker/test_worker_vision.py; 256 tokens outlast any coalescing on the way:
    # 64 did not once, on a loaded 2-core machine, where the handler first read after the last).
    long = vclient.chat.completions.create(model=model, messages=ask(data_url()),
                                           max_tokens=256, temperature=0)
    chunks = list(vclient.chat.completions.create(model=model, messages=ask(data_url()),
                                                  max_tokens=256, temperature=0, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1 and "".join(texts) == long.choices[0].message.content
    other = vclient.chat.completions.create(model=model, messages=ask(data_url(seed=3, fmt="JPEG")),
                                            max_tokens=8, temperature=0)
    assert other.choices[0].message.content != r.choices[0].message.content


def test_bad_images_are_400s_and_the_model_serves_on(vclient, vision_model):
    model = str(vision_model)
    bad = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=model, messages=ask(bad), max_tokens=2)
    assert "could not be decoded" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=model, messages=ask("https://example.com/a.png"),
                                        max_tokens=2)
    assert e.value.body["code"] == "invalid_image_url"
    r = vclient.chat.completions.create(model=model, messages=ask(data_url()), max_tokens=2,
                                        temperature=0)  # (sampled, EOS may come first)
    assert r.usage.completion_tokens == 2


def test_responses_input_image_and_a_chain_that_goes_on_from_it(vclient, vision_model):
    model = str(vision_model)
    first = vclient.responses.create(model=model, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is in the picture?"},
                                     {"type": "input_image", "image_url": data_url()}]}])
    chat = vclient.chat.completions.create(model=model, messages=ask(data_url()), max_tokens=6,
                                           temperature=0)
    assert first.output_text == chat.choices[0].message.content  # the same prompt, image
    # The next turn replays the stored image from the chain (previous_response_id).
    nxt = vclient.responses.create(model=model, max_output_tokens=3, temperature=0,
                                   previous_response_id=first.id, input="And the colours?")
    assert nxt.status == "completed" or nxt.status == "incomplete"
    assert nxt.usage.input_tokens > first.usage.input_tokens


def test_demo_vision_is_built_on_first_use_and_served_by_name():
    with ServerProcess(["demo-vision"]) as srv:
        srv.wait_healthy(timeout=120)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        assert client.models.retrieve("demo-vision").model_extra["kind"] == "vision"
        r = client.chat.completions.create(model="demo-vision", messages=ask(data_url()),
                                           max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        assert (srv.state_dir / "models" / "demo-vision" / "preprocessor_config.json").is_file()


def test_the_messages_api_takes_image_blocks(vserver, vision_model, server, model_id):
    import anthropic

    png = base64.b64decode(data_url().split(",", 1)[1])
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}}
    ask_ = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                         block]}]
    vision = anthropic.Anthropic(base_url=vserver.url, api_key="x", max_retries=0)
    m = vision.messages.create(model=str(vision_model), max_tokens=4, messages=ask_,
                               extra_body={"temperature": 0})  # (not a create() argument)
    assert m.usage.output_tokens == 4 and m.stop_reason == "max_tokens"
    text = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:  # a text model, in Anthropic's envelope
        text.messages.create(model=model_id, max_tokens=4, messages=ask_)
    assert e.value.body["type"] == "error" and "cannot read images" in e.value.body["error"]["message"]


def test_local_images_from_the_allowed_media_dir(vclient, vision_model, media_dir, tmp_path):
    model = str(vision_model)
    png = base64.b64decode(data_url().split(",", 1)[1])
    (media_dir / "cat.png").write_bytes(png)
    (tmp_path / "other.png").write_bytes(png)
    inline = vclient.chat.completions.create(model=model, messages=ask(data_url()),
                                             max_tokens=5, temperature=0)
    local = vclient.chat.completions.create(model=model, messages=ask(f"file://{media_dir}/cat.png"),
                                            max_tokens=5, temperature=0)
    assert local.choices[0].message.content == inline.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=model, messages=ask(str(tmp_path / "other.png")),
                                        max_tokens=2)
    assert e.value.body["param"] == "messages[0].content[1].image_url.url"


def one_bit_png_url(w, h) -> str:
    """A blank one-bit PNG as a data: URL: a few KB however many pixels."""
    buf = io.BytesIO()
    Image.new("1", (w, h)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def worker_peak_rss(srv, model) -> tuple[int, int | None]:
    """The model's worker's pid (/health) and its peak resident memory (Linux's VmHWM;
    None where /proc has none)."""
    _, health = srv.get("/health")
    pid = next(w["pid"] for w in health["workers"] if w["model"] == model)
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return pid, None
    return pid, int(status.split("VmHWM:")[1].split()[0]) * 1024


def test_an_image_bomb_is_a_400_on_every_surface_and_is_never_decoded(vserver, vclient,
                                                                      vision_model):
    # The outside tester's bomb (issue 30): 13,000 × 13,000 one-bit pixels in a 20 KB PNG,
    # 169 MB decoded as PIL holds it and over 2 GB once the processor had made arrays of it.
    import anthropic

    model = str(vision_model)
    bomb = one_bit_png_url(13000, 13000)
    assert len(bomb) < 32 << 10
    vclient.chat.completions.create(model=model, messages=ask(data_url()), max_tokens=1)
    pid, peak_before = worker_peak_rss(vserver, model)
    said = "image 1 of the request is 13000x13000 = 169,000,000 pixels, over this model's " \
           "bound of 16,777,216 pixels per image"
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=model, messages=ask(bomb), max_tokens=2)
    assert said in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        vclient.responses.create(model=model, max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": bomb}]}])
    assert said in e.value.body["message"]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": bomb.split(",", 1)[1]}}
    messages = anthropic.Anthropic(base_url=vserver.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        messages.messages.create(model=model, max_tokens=2,
                                 messages=[{"role": "user", "content": [block]}])
    assert e.value.body["type"] == "error" and said in e.value.body["error"]["message"]
    # A request whose images are each within the bound and together over it: 5 × 16.8 M.
    within = one_bit_png_url(4096, 4096)
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": within}}] * 5}])
    assert "the request's 5 images hold 83,886,080 pixels together, over this model's " \
           "bound of 67,108,864 pixels per request" in e.value.body["message"]
    # Nothing was decoded: the worker's peak memory grew by far less than one bomb's
    # 169 MB (decoded, it grew by over 2 GB), and the same worker serves on.
    pid_after, peak_after = worker_peak_rss(vserver, model)
    if peak_before is not None:
        assert peak_after - peak_before < 64 << 20, (peak_before, peak_after)
    assert pid_after == pid
    r = vclient.chat.completions.create(model=model, messages=ask(data_url()), max_tokens=2,
                                        temperature=0)
    assert r.usage.completion_tokens == 2


def test_audio_to_a_vision_model_is_a_400_in_each_surfaces_envelope(vserver, vclient,
                                                                      vision_model):
    # mlx-vlm 0.7.10 reads audio only with audio towers (Gemma 3n/4, Qwen3-Omni, Phi-4-MM,
    # MiniCPM-o): Qwen2-VL has none, so its worker refuses audio in the turn being
    # answered (worker/text/prompt.py), and earlier in the conversation it stands as
    # "[audio]" (tests/worker/test_worker_vision_audio.py: a model that hears it).
    import anthropic

    model = str(vision_model)
    wav = base64.b64encode(b"RIFF" + bytes(40)).decode()
    audio = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as e:
        vclient.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is said?"}, audio]}])
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == "messages[0].content"
    assert "cannot read audio" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        vclient.responses.create(model=model, max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is said?"},
                                         audio]}])
    assert "cannot read audio" in e.value.body["message"]
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": base64.b64encode(b"%PDF-1.4").decode()}}
    messages = anthropic.Anthropic(base_url=vserver.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:  # (Messages has no audio block)
        messages.messages.create(model=model, max_tokens=2,
                                 messages=[{"role": "user", "content": [pdf]}])
    assert e.value.body["type"] == "error"
    assert "cannot read documents" in e.value.body["error"]["message"]
    r = vclient.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hear this"}, audio]},
        {"role": "assistant", "content": "I cannot hear it."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                     {"type": "image_url", "image_url": {"url": data_url()}}]}])
    assert r.usage.completion_tokens == 2
