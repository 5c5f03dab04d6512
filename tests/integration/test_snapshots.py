"""KV snapshots end to end (worker/kvcache/): a Responses chain with the official client
prefills only each turn's new items, from memory, from the disk tier after `mlxctl kill`
and after mlxd itself restarted, with the output a cold run gives; a snapshot file whose
tensor table was edited on disk is not resumed (deleted, counted) and the answer is the
cold one; a template that rewrites history falls back, counted, to the right output;
mlxctl cache lists, saves, drops and clears.

The chain runs on the real SmolLM2 (a real tokenizer: its replies, rendered back into
the next prompt, tokenize as they were generated); the rewriting template is the tiny
Qwen-family model's, which leaves past turns' reasoning out of the history; the edited
file and mlxctl cache need no real text, so the tiny model serves them.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.test_faults import wait_for
from tests.integration.test_mlxctl import mlxctl, ok
from tests.serverproc import ServerProcess
from tests.worker.test_snapshot_files import edit_header, swap_offsets

pytestmark = pytest.mark.integration

QUESTIONS = ["Name three colors.", "And three animals?", "Now three fruits.",
             "And three cars?", "Three rivers?"]


def stats(srv, **want) -> dict:
    """The worker's snapshot counters (its report in /health, which mlxctl status shows),
    once they show `want`: heartbeats carry them, about once a second. Read over HTTP: an
    mlxctl process a reading took over a second of a loaded machine's time."""
    last = {}

    def shows():
        nonlocal last
        (w,) = srv.get("/health")[1]["workers"]
        last = (w["prompt_cache"] or {}).get("snapshots") or {}
        return last and all(last.get(k) == v for k, v in want.items())

    try:
        wait_for(shows, 20, interval=0.3)
    except AssertionError:
        raise AssertionError(f"snapshot counters {last} never showed {want}") from None
    return last


def ask(client, model, question, previous=None, **kw):
    return client.responses.create(model=model, input=question, previous_response_id=previous,
                                   max_output_tokens=8, temperature=0, **kw)


def assert_resumed(before, after):
    """`after` continued `before` from its final state: everything `before` held (its
    input, its output, and the end-of-turn token when it stopped on one) was reused."""
    held = before.usage.input_tokens + before.usage.output_tokens
    assert after.usage.input_tokens_details.cached_tokens - held in (0, 1)
    assert after.usage.input_tokens > after.usage.input_tokens_details.cached_tokens


def test_a_chain_resumes_from_memory_from_disk_and_after_a_restart(real_model_dir, tmp_path):
    state, model = tmp_path, str(real_model_dir)
    with ServerProcess([model], state_dir=state) as srv:
        srv.wait_healthy(300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        turns = [ask(client, model, QUESTIONS[0])]
        for q in QUESTIONS[1:3]:
            turns.append(ask(client, model, q, turns[-1].id))
        for before, after in zip(turns, turns[1:]):
            assert_resumed(before, after)
        stats(srv, hits_ram=2, hits_disk=0, fallbacks=0)
        listed = json.loads(ok(mlxctl(srv, "cache", "ls", "--json")).stdout)
        names = {s["name"] for s in listed["models"][0]["snapshots"]}
        assert names == {t.id for t in turns}
        stats(srv, disk_entries=3)
        # The worker is killed: its memory is gone, the disk tier is not.
        pid = srv.worker_pids()[0]
        ok(mlxctl(srv, "kill"))
        # One reading per try: the old worker may be gone between two.
        wait_for(lambda: (pids := srv.worker_pids()) and pids[0] != pid, 60)
        srv.wait_healthy(120)
        turns.append(ask(client, model, QUESTIONS[3], turns[-1].id))
        assert_resumed(turns[2], turns[3])
        assert stats(srv, hits_disk=1, hits_ram=0, disk_entries=4)["disk_read_bytes"] > 0
    # mlxd itself restarts on the same state directory: store and snapshots survive.
    with ServerProcess([model], state_dir=state) as srv:
        srv.wait_healthy(300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        resumed = ask(client, model, QUESTIONS[4], turns[-1].id)
        assert_resumed(turns[3], resumed)
        stats(srv, hits_disk=1, misses=0)
        # Temperature 0: the same conversation prefilled cold (its own cache namespace,
        # nothing stored) answers the same.
        items = []
        for question, t in zip(QUESTIONS, turns):
            items += [{"role": "user", "content": question},
                      {"role": "assistant", "content": t.output_text}]
        cold = client.responses.create(model=model, input=items + [
            {"role": "user", "content": QUESTIONS[4]}], max_output_tokens=8, temperature=0,
            store=False, extra_body={"prompt_cache_key": "cold"})
        assert cold.usage.input_tokens_details.cached_tokens == 0
        assert cold.usage.input_tokens == resumed.usage.input_tokens
        assert cold.output_text == resumed.output_text


def test_an_edited_snapshot_file_is_not_resumed_and_the_answer_is_the_cold_one(
        tiny_model, tmp_path):
    # The tiny model: unedited, this file resumes the second turn whole (24 of its 56
    # tokens), and it starts in seconds where the real one takes 20.
    model = str(tiny_model)
    # A prompt cache too small for any state: a snapshot is on disk only, and the next
    # turn can only resume from the file.
    with ServerProcess([model], "--prompt-cache-bytes", "1024", state_dir=tmp_path) as srv:
        srv.wait_healthy(300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        first = ask(client, model, QUESTIONS[0])
        stats(srv, disk_entries=1, named=0)
        (path,) = (tmp_path / "kv").glob("*/*.safetensors")
        edit_header(path, swap_offsets)  # the outside tester's edit: the data untouched
        second = ask(client, model, QUESTIONS[1], first.id)
        stats(srv, disk_corrupt=1, hits_disk=0, misses=1)
        assert second.usage.input_tokens_details.cached_tokens == 0 and not path.exists()
        cold = client.responses.create(model=model, input=[
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": QUESTIONS[1]}], max_output_tokens=8, temperature=0,
            store=False, extra_body={"prompt_cache_key": "cold"})
        assert cold.usage.input_tokens_details.cached_tokens == 0
        assert cold.usage.input_tokens == second.usage.input_tokens
        assert cold.output_text == second.output_text


def test_a_history_rewriting_template_falls_back_counted(family_model, tmp_path):
    model = str(family_model("qwen"))  # past reasoning is left out of the history
    with ServerProcess([model], "--max-batch-size", "1", state_dir=tmp_path) as srv:
        srv.wait_healthy(120)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        first = ask(client, model, "hello")
        assert any(o.type == "reasoning" for o in first.output)
        second = ask(client, model, "more", first.id)
        stats(srv, fallbacks=1, hits_ram=0)
        # Prefix matching still shared what the rewrite left alone, and the output is
        # the cold one.
        assert 0 < second.usage.input_tokens_details.cached_tokens < (
            first.usage.input_tokens + first.usage.output_tokens)
        items = [{"role": "user", "content": "hello"},
                 *[o.model_dump(exclude_none=True) for o in first.output],
                 {"role": "user", "content": "more"}]
        cold = client.responses.create(model=model, input=items, max_output_tokens=8,
                                       temperature=0, store=False,
                                       extra_body={"prompt_cache_key": "cold"})
        assert cold.usage.input_tokens_details.cached_tokens == 0
        assert cold.output_text == second.output_text


def test_mlxctl_cache_save_drop_clear(tiny_model, tmp_path):
    """The commands and the files they act on: any model that snapshots proves them, so
    the tiny one (the real one only spent this CPU's time decoding)."""
    model = str(tiny_model)
    with ServerProcess([model], "--kv-disk-bytes", "1G", state_dir=tmp_path) as srv:
        srv.wait_healthy(300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        a = ask(client, model, QUESTIONS[0])
        b = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            temperature=0, extra_body={"prompt_cache_key": "conv-7"})
        assert b.choices[0].message.content is not None
        stats(srv, disk_entries=2)
        text = ok(mlxctl(srv, "cache", "ls")).stdout
        assert a.id in text and "key:conv-7" in text
        files = list((tmp_path / "kv").glob("*/*.safetensors"))
        assert len(files) == 2 and all(f.stat().st_mode & 0o077 == 0 for f in files)
        assert "conv-7" not in " ".join(f.name for f in files)  # names are hashed
        ok(mlxctl(srv, "cache", "drop", a.id))
        stats(srv, disk_entries=1)
        missing = mlxctl(srv, "cache", "drop", a.id)
        assert missing.returncode == 1 and "no snapshot named" in missing.stderr
        ok(mlxctl(srv, "cache", "save", "key:conv-7"))  # already on disk: says so
        ok(mlxctl(srv, "cache", "clear"))
        stats(srv, disk_entries=0)
        assert not list((tmp_path / "kv").glob("*/*.safetensors"))
        assert "no KV snapshots" in ok(mlxctl(srv, "cache", "ls")).stdout
