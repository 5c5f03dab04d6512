"""mlxctl without a server: argument wiring, `pull` with an injected hub (never
the network), `logs`, the human tables."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlxctl import client as ctl
from mlxctl.format import format_cache, format_models, format_status, human_bytes, human_seconds
from tests.serverproc import REPO, free_port
from tests.supervisor.test_catalog import model


def run(capsys, *argv, deps=None) -> tuple[int, str, str]:
    code = ctl.main(list(argv), deps)
    out = capsys.readouterr()
    return code, out.out, out.err


class FakeHub:
    """The hub a pull talks to, in memory: `files` {repo: [(name, size)]}, `paths` where
    each repo's downloads land (a model directory the test made)."""

    def __init__(self, files, paths, cached=()):
        self.listing, self.paths, self.cached_names = files, paths, set(cached)
        self.downloads = []

    def files(self, repo, revision):
        if repo not in self.listing:
            raise OSError("404 Client Error: Repository Not Found for url: …")
        return "c" * 40, self.listing[repo]

    def cached(self, repo, filename, commit):
        return str(self.paths[repo] / filename) if filename in self.cached_names else None

    def download(self, repo, filename, revision, bar):
        self.downloads.append((repo, filename, revision))
        size = dict(self.listing[repo])[filename]
        with bar(total=size, initial=0) as b:
            b.update(size)
        return str(self.paths[repo] / filename)


def test_pull_fetches_the_files_the_loader_reads_and_reports_mlx(tmp_path, capsys):
    snap = model(tmp_path, "snap")
    files = [("config.json", 10), ("model.safetensors", 100), ("README.md", 5),
             ("pytorch_model.bin", 1000), ("tokenizer.json", 20)]
    hub = FakeHub({"org/m": files}, {"org/m": snap}, cached=["tokenizer.json"])
    code, out, err = run(capsys, "--url", "http://127.0.0.1:1", "pull", "org/m", "--revision",
                         "v2", "--json", deps=ctl.Deps(hub=hub))
    assert code == 0, err
    # Only what mlx-lm loads, and not what the cache already holds.
    assert hub.downloads == [("org/m", "config.json", "v2"), ("org/m", "model.safetensors", "v2")]
    events = [json.loads(line) for line in out.splitlines()]
    assert events[0]["event"] == "start" and events[0]["total_bytes"] == 130
    done = {e["file"]: e for e in events if e["event"] == "done"}
    assert done["tokenizer.json"]["cached"] is True and done["model.safetensors"]["bytes"] == 100
    body = events[-1]
    assert body["event"] == "complete" and body["mlx"] is True
    assert body["path"].endswith("snap") and body["size_bytes"] > 0
    pt = model(tmp_path, "pt", fmt="pt")
    code, out, _ = run(capsys, "pull", "org/pt", deps=ctl.Deps(hub=FakeHub(
        {"org/pt": [("config.json", 1), ("model.safetensors", 1)]}, {"org/pt": pt})))
    assert code == 0 and "does not look like an MLX model" in out


def test_pull_of_one_gguf_file(tmp_path, capsys):
    gguf = tmp_path / "m-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    hub = FakeHub({"org/m-GGUF": [("m-Q4_K_M.gguf", 64), ("m-Q8_0.gguf", 99),
                                  ("config.json", 3)]}, {"org/m-GGUF": tmp_path})
    code, out, _ = run(capsys, "pull", "org/m-GGUF", "--gguf", "m-Q4_K_M.gguf", "--json",
                       deps=ctl.Deps(hub=hub))
    assert code == 0 and hub.downloads == [("org/m-GGUF", "m-Q4_K_M.gguf", None)]
    body = json.loads(out.splitlines()[-1])
    assert body["gguf"] is True and body["path"] == str(gguf) and body["size_bytes"] == 64
    code, out, err = run(capsys, "pull", "org/m-GGUF", "--gguf", "m.safetensors",
                         deps=ctl.Deps(hub=hub))
    assert code == 2 and "names a .gguf file" in err
    code, out, err = run(capsys, "pull", "org/m-GGUF", "--gguf", "other.gguf",
                         deps=ctl.Deps(hub=hub))
    assert code == 1 and "no such file" in err


def test_pull_failure_is_a_message_and_exit_1(capsys):
    code, out, err = run(capsys, "pull", "org/none", deps=ctl.Deps(hub=FakeHub({}, {})))
    assert code == 1 and "could not download org/none" in err and "Repository Not Found" in err
    assert "Traceback" not in err


def test_pull_default_patterns_are_what_the_worker_loads():
    from mlxctl.pull import PULL_PATTERNS

    assert "model*.safetensors" in PULL_PATTERNS and "*.json" in PULL_PATTERNS


@pytest.mark.parametrize("argv,rest,passthrough", [
    (["serve", "--model", "demo"], ["serve"], ["--model", "demo"]),
    (["--url", "http://x", "service", "install", "--model", "m"],
     ["--url", "http://x", "service", "install"], ["--model", "m"]),
    (["service", "status"], ["service", "status"], None),
    (["--url", "serve", "status"], ["--url", "serve", "status"], None),  # a value, not a command
    (["status", "--json"], ["status", "--json"], None),
])
def test_passthrough_split(argv, rest, passthrough):
    assert ctl._split_passthrough(argv) == (rest, passthrough)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        ctl.main(["swap"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        ctl.main(["unload", "m", "--drain", "--force"])
    assert e.value.code == 2


def test_logs_when_the_server_is_down_reads_the_state_dirs_log(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "mlxd.log").write_text("".join(f"line {i}\n" for i in range(100)))
    code, out, _ = run(capsys, "--url", f"http://127.0.0.1:{free_port()}", "--state-dir",
                       str(tmp_path), "logs", "-n", "3")
    assert code == 0 and out.splitlines() == ["line 97", "line 98", "line 99"]
    code, _, err = run(capsys, "--url", f"http://127.0.0.1:{free_port()}", "--state-dir",
                       str(tmp_path / "other"), "logs")
    assert code == 1 and "no log" in err


def test_logs_follow_prints_appended_lines_and_survives_rotation(tmp_path):
    log = tmp_path / "logs" / "mlxd.log"
    log.parent.mkdir()
    log.write_text("old\n")
    proc = subprocess.Popen([sys.executable, "-m", "mlxctl.client", "--url",
                             f"http://127.0.0.1:{free_port()}", "--state-dir", str(tmp_path),
                             "logs", "-f", "-n", "1"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "old\n"
        with open(log, "a") as f:
            f.write("new one\n")
        assert proc.stdout.readline() == "new one\n"
        log.rename(log.with_suffix(".log.1"))  # what RotatingFileHandler does
        log.write_text("after rotation\n")
        assert proc.stdout.readline() == "after rotation\n"
    finally:
        proc.terminate()
        proc.wait(10)


def test_human_formats():
    assert human_bytes(None) == "-" and human_bytes(512) == "512 B"
    assert human_bytes(3 << 29) == "1.5 GiB" and human_bytes(5 << 20) == "5.0 MiB"
    assert human_seconds(None) == "-" and human_seconds(59) == "59s"
    assert human_seconds(61) == "1m01s" and human_seconds(3700) == "1h01m"
    status = format_status({
        "status": "ok", "memory": {"available_bytes": 8 << 30, "total_bytes": 16 << 30,
                                   "pressure": "warn"},
        "workers": [{"model": "m", "kind": "text", "state": "ready", "pid": 42, "uptime_s": 5, "rss_bytes": 1 << 30,
                     "active_bytes": 1 << 29, "peak_bytes": 1 << 30, "queued": 2, "in_flight": 1,
                     "tokens_per_s": 12.345, "restarts": 1,
                     "kv": {"bits": 8, "bytes_per_token": 12960.0, "bytes": 1 << 20,
                            "tokens": 12345},
                     "speculation": {"verifications": 10, "acceptance": 0.685,
                                     "tokens_per_verification": 3.7411},
                     "prompt_cache": {"hits": 3, "misses": 1, "bytes": 3 << 20,
                                      "snapshots": {"hits_ram": 4, "hits_disk": 2}}}]})
    lines = status.splitlines()
    assert lines[0] == "status: ok"
    assert lines[1] == "memory: 8.0 GiB available of 16.0 GiB, pressure warn"
    assert lines[2].split() == ["MODEL", "KIND", "STATE", "PID", "UPTIME", "RSS", "MLX", "ACTIVE", "MLX",
                                "PEAK", "QUEUED", "IN-FLIGHT", "TOK/S", "(1m)", "CACHE", "HITS",
                                "CACHE", "MEM", "RESUMED", "RAM/DISK", "KV/TOKEN", "KV",
                                "TOKENS", "DRAFTS", "OK,",
                                "TOK/VERIFY", "RESTARTS"]
    assert lines[3].split() == ["m", "text", "ready", "42", "5s", "1.0", "GiB", "512.0", "MiB", "1.0", "GiB",
                                "2", "1", "12.3", "3/4", "3.0", "MiB", "4/2", "12.7", "KiB", "q8",
                                "12,345", "68%,", "3.74", "1"]
    converting = format_status({"status": "ok", "workers": [
        {"model": "m.gguf", "state": "starting", "load_progress": 0.42}]}).splitlines()
    assert converting[-1].split()[:3] == ["m.gguf", "-", "starting(42%)"]
    full = format_status({"status": "ok", "workers": [
        {"model": "f", "state": "ready", "kv": {"bits": 0, "bytes_per_token": 46080.0,
                                                "bytes": 0, "tokens": 0}}]}).splitlines()
    assert full[-1].split()[-5:-2] == ["45.0", "KiB", "0"]  # full precision: no qN
    busy = format_status({"status": "ok", "workers": [
        {"model": "w", "kind": "stt", "state": "busy", "progress": 0.5}]}).splitlines()
    assert busy[-1].split()[:3] == ["w", "stt", "busy(50%)"]
    group = format_status({"status": "ok", "workers": [
        {"model": "big", "state": "ready", "group": {
            "size": 2, "backend": "ring", "sharding": "tensor", "latency_s": 0.00012,
            "bandwidth_bytes_s": 2.5e9, "ranks": [
                {"rank": 0, "host": "mac1", "pid": 11, "free_bytes": 48 << 30,
                 "active_bytes": 20 << 30, "peak_bytes": 21 << 30},
                {"rank": 1, "host": "mac2", "pid": 22, "free_bytes": 50 << 30,
                 "active_bytes": 20 << 30, "peak_bytes": 22 << 30}]}}]}).splitlines()
    assert group[-4] == ("big: a group of 2 (tensor parallel over ring); link: all-reduce "
                         "120 us, 2.50 GB/s")
    assert group[-3].split()[:3] == ["RANK", "HOST", "PID"]
    assert group[-1].split() == ["1", "mac2", "22", "50.0", "GiB", "20.0", "GiB", "22.0", "GiB"]
    assert "no local MLX models" in format_models({"models": []})
    table = format_models({"models": [{"id": "org/m", "size_bytes": 4 << 30, "context_length": 32768,
                                       "state": "not_loaded", "source": "hf-cache"}]})
    assert table.splitlines()[1].split() == ["org/m", "4.0", "GiB", "32768", "not_loaded", "hf-cache"]


def test_cache_listing_format():
    now = 1000.0
    body = {"models": [
        {"model": "m", "snapshots": [
            {"name": "resp_1", "tokens": 2048, "ram_bytes": 3 << 20, "disk_bytes": 4 << 20,
             "used_at": now - 90},
            {"name": "key:conv", "tokens": 17, "ram_bytes": 0, "disk_bytes": 1 << 10,
             "used_at": now - 5}]},
        {"model": "e", "error": "this worker keeps no KV snapshots"}]}
    lines = format_cache(body, now).splitlines()
    assert lines[0].split() == ["MODEL", "NAME", "TOKENS", "MEMORY", "DISK", "USED"]
    assert lines[1].split() == ["m", "resp_1", "2048", "3.0", "MiB", "4.0", "MiB", "1m30s", "ago"]
    assert lines[2].split() == ["m", "key:conv", "17", "-", "1.0", "KiB", "5s", "ago"]
    assert lines[3] == "e: this worker keeps no KV snapshots"
    assert "no KV snapshots" in format_cache({"models": [{"model": "m", "snapshots": []}]}, now)
