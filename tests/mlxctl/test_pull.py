"""`mlxctl pull` against a local server that speaks the Hugging Face file API (HF_ENDPOINT):
the right files land in the cache byte for byte, --json progress adds up, the token never
goes to the LFS CDN, a broken connection is resumed with a Range, a failed or interrupted
pull resumes on the next one, a pull of what is there downloads nothing; and the progress
display as text, on a pseudo-terminal too."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from mlxctl.progress import Progress
from tests.hubserver import Hub, HubServer, Repo
from tests.serverproc import REPO
from tests.supervisor.test_catalog import safetensors

# A pull has huggingface_hub write what arrives in 1 MiB pieces (DOWNLOAD_CHUNK_SIZE), so a
# resume starts at a whole MiB: the weights are several, and connections break mid-piece.
BIG = 6 << 20
CUT = 7 << 19   # 3.5 MiB
WEIGHTS = "model.safetensors"
WANTED = ("config.json", WEIGHTS, "tokenizer.json", "tokenizer/special.json")


def repo_files(tmp_path) -> dict[str, bytes]:
    w = tmp_path / "w.safetensors"
    safetensors(w, {"format": "mlx"})   # `mlx: true` in the report needs MLX metadata
    weights = w.read_bytes() + os.urandom(BIG)   # a valid header, then bytes to carry
    # A nested file matches `*.json` (fnmatch's `*` crosses `/`, as in huggingface_hub)
    # and sorts last: the reported path must still be the snapshot's root.
    return {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"t": 1}' * 50,
            "tokenizer/special.json": b"{}", WEIGHTS: weights, "README.md": b"# hi",
            "pytorch_model.bin": b"x" * 999}


def env_for(url, cache, **extra) -> dict:
    return {**os.environ, "HF_ENDPOINT": url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", **extra}


def argv_for(*args) -> list[str]:
    return [sys.executable, "-m", "mlxctl.client", "--url", "http://127.0.0.1:9",
            "pull", *args]


def ctrl_c_reaches_it() -> None:
    """In the child before it runs: Ctrl-C's default, which a test run started in the
    background of a shell (`make test &`: SIGINT ignored, and inherited) would not give."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pull(url, cache, *args, wait=True, **env):
    if not wait:
        return subprocess.Popen(argv_for(*args), cwd=REPO, env=env_for(url, cache, **env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=ctrl_c_reaches_it)
    return subprocess.run(argv_for(*args), cwd=REPO, env=env_for(url, cache, **env),
                          capture_output=True, text=True, timeout=120)


def snapshot(cache, repo_id="org/tiny"):
    refs = cache / ("models--" + repo_id.replace("/", "--")) / "refs" / "main"
    return refs.parent.parent / "snapshots" / refs.read_text().strip()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def assert_pulled(cache, files):
    snap = snapshot(cache)
    for name in WANTED:
        assert sha((snap / name).read_bytes()) == sha(files[name]), name
    assert not (snap / "README.md").exists() and not (snap / "pytorch_model.bin").exists()
    return snap


def test_a_pull_fetches_what_the_loader_reads_with_json_progress(tmp_path):
    files = repo_files(tmp_path)
    hub = Hub({"org/tiny": Repo(files)}, lfs={WEIGHTS})   # the weights through the "CDN"
    with HubServer(hub) as url:
        out = pull(url, tmp_path / "hub", "org/tiny", "--json", HF_TOKEN="hf_secret")
        assert out.returncode == 0, out.stderr
        events = [json.loads(line) for line in out.stdout.splitlines()]
        # Pulled again: all there, nothing sent.
        served = dict(hub.served)
        again = pull(url, tmp_path / "hub", "org/tiny")
        assert again.returncode == 0, again.stderr
        assert hub.served == served
        assert again.stderr.count(": cached") == len(WANTED)
    snap = assert_pulled(tmp_path / "hub", files)
    assert set(hub.served) == set(WANTED)   # README.md, pytorch_model.bin: never asked for
    # The token went to the Hub, never to the CDN the weights were redirected to.
    assert ("/api/models/org/tiny", "Bearer hf_secret") in [
        (p.split("?")[0], a) for p, a in hub.auth]
    cdn = [a for p, a in hub.auth if p.startswith("/cdn/")]
    assert cdn and not any(cdn)
    start, complete = events[0], events[-1]
    assert start["event"] == "start" and start["total_bytes"] == sum(len(files[n]) for n in WANTED)
    assert complete["event"] == "complete" and complete["mlx"] is True
    assert complete["model"] == "org/tiny" and complete["path"] == str(snap)
    assert complete["size_bytes"] >= len(files[WEIGHTS])
    done = {e["file"]: e["bytes"] for e in events if e["event"] == "done"}
    assert done == {n: len(files[n]) for n in WANTED}
    assert sum(done.values()) == start["total_bytes"]
    progress = [e["bytes"] for e in events if e["event"] == "file" and e["file"] == WEIGHTS]
    assert progress == sorted(progress) and progress[-1] <= len(files[WEIGHTS])


def test_a_broken_connection_is_resumed_with_a_range(tmp_path):
    files = repo_files(tmp_path)
    hub = Hub({"org/tiny": Repo(files)}, cut_after={WEIGHTS: CUT})
    with HubServer(hub) as url:
        out = pull(url, tmp_path / "hub", "org/tiny")
    assert out.returncode == 0, out.stderr
    assert_pulled(tmp_path / "hub", files)
    assert hub.offsets(WEIGHTS) and hub.offsets(WEIGHTS)[0] > 0
    assert hub.served[WEIGHTS] < 1.2 * len(files[WEIGHTS])   # not downloaded twice


def test_a_failed_pull_exits_1_and_the_next_resumes(tmp_path):
    files = repo_files(tmp_path)
    # Cut at 3.5 MiB, then 503 for that file: this pull cannot finish.
    hub = Hub({"org/tiny": Repo(files)}, lfs={WEIGHTS}, fail_after={WEIGHTS: CUT})
    cache = tmp_path / "hub"
    with HubServer(hub) as url:
        out = pull(url, cache, "org/tiny", "--json")
        assert out.returncode == 1
        last = json.loads(out.stdout.splitlines()[-1])   # a script's stream ends, and says why
        assert last["event"] == "error" and "again to resume" in last["message"]
        assert "could not download org/tiny" in out.stderr
        assert "run the same command again to resume" in out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 4
        kept = sum(p.stat().st_size for p in cache.rglob("*.mlxd-part"))
        assert kept > 0
        first = hub.served[WEIGHTS]
        hub.mend()   # the network is back
        out = pull(url, cache, "org/tiny")
    assert out.returncode == 0, out.stderr
    assert_pulled(cache, files)
    assert kept == 3 << 20 and hub.offsets(WEIGHTS)[-1] == kept   # resumed where it stopped
    assert hub.served[WEIGHTS] - first == len(files[WEIGHTS]) - kept
    assert hub.served[WEIGHTS] < 1.2 * len(files[WEIGHTS])
    assert not list(cache.rglob("*.mlxd-part"))


def test_an_interrupted_pull_resumes_on_the_next(tmp_path):
    files = repo_files(tmp_path)
    hub = Hub({"org/tiny": Repo(files)}, rate=2 << 20)   # 2 MiB/s: ~3 s for the weights
    cache = tmp_path / "hub"
    with HubServer(hub) as url:
        proc = pull(url, cache, "org/tiny", wait=False)
        deadline = time.monotonic() + 30
        while hub.served.get(WEIGHTS, 0) < CUT:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)   # Ctrl-C
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "interrupted" in err and "again to resume" in err and "Traceback" not in err
        first = hub.served[WEIGHTS]
        hub.rate = None
        out = pull(url, cache, "org/tiny")
    assert out.returncode == 0, out.stderr
    assert_pulled(cache, files)
    assert hub.offsets(WEIGHTS) and 0 < hub.offsets(WEIGHTS)[-1] <= first
    assert hub.served[WEIGHTS] < 1.2 * len(files[WEIGHTS])


def test_an_unknown_repo_is_one_line_and_exit_1(tmp_path):
    with HubServer(Hub()) as url:
        out = pull(url, tmp_path / "hub", "org/none")
    assert out.returncode == 1
    assert out.stderr.startswith("mlxctl: could not download org/none: RepositoryNotFoundError")
    assert len(out.stderr.strip().splitlines()) == 1


def test_on_a_terminal_the_bars_are_drawn_in_place(tmp_path):
    """A real pseudo-terminal on stderr: the display redraws with ANSI moves, has the
    overall line, and says what the cache already held."""
    files = repo_files(tmp_path)
    cache = tmp_path / "hub"
    full = Repo(files)
    # First the config alone (same commit), so the real pull finds one file cached.
    with HubServer(Hub({"org/tiny": Repo({"config.json": files["config.json"]},
                                         commit=full.commit)})) as url:
        assert pull(url, cache, "org/tiny").returncode == 0
    with HubServer(Hub({"org/tiny": full})) as url:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))
        proc = subprocess.Popen(argv_for("org/tiny"), cwd=REPO, env=env_for(url, cache),
                                stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        screen = b""
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:   # the other end closed: the pull has ended
                break
            if not data:
                break
            screen += data
        os.close(master)
        assert proc.wait(timeout=60) == 0
    text = screen.decode()
    assert "\x1b[J" in text and "\x1b[" in text.replace("\x1b[J", "")   # redrawn in place
    assert "overall" in text and "(4/4 files)" in text
    assert "config.json" in text and "cached" in text
    assert "\r\n" in text and "Traceback" not in text


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_terminal_display_has_a_bar_per_file_and_overall_with_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    p = Progress([("config.json", 100), ("model.safetensors", 10 << 20), ("tok.json", 50)],
                 out=out, tty=True, clock=clock, width=140)
    p.finish("config.json", cached=True)
    p.start("model.safetensors", 10 << 20, initial=2 << 20)   # resumed at 2 MiB
    clock.t += 2
    p.advance("model.safetensors", 4 << 20)                   # 4 MiB in 2 s this run
    lines = p.lines()   # the live part: the file in progress, then overall
    assert len(lines) == 2
    weights, overall = lines
    assert weights.startswith("model.safetensors") and "[" + "#" * 14 in weights
    assert "60%" in weights and "6.0 MiB/10.0 MiB" in weights
    assert "2.0 MiB/s" in weights and "ETA 2s" in weights        # 4 MiB left at 2 MiB/s
    assert overall.startswith("overall") and "(1/3 files)" in overall
    assert "2.0 MiB/s" in overall and "ETA 2s" in overall
    clock.t += 1
    p.advance("model.safetensors", 4 << 20)
    p.finish("model.safetensors")
    shown = out.getvalue()
    # Finished files leave one line above the live part; the live part is redrawn.
    assert "config.json" in shown and "cached" in shown
    assert "[" + "#" * 24 + "] 100%" in shown and "\x1b[J" in shown and "\x1b[2F" in shown
    assert p.lines()[-1].startswith("overall") and "(2/3 files)" in p.lines()[-1]
    narrow = Progress([("a-very-long-file-name-indeed.safetensors", 10)], width=40,
                      clock=clock)
    narrow.start("a-very-long-file-name-indeed.safetensors", 10)
    assert all(len(line) <= 40 for line in narrow.lines())


def test_a_repo_of_many_files_keeps_the_live_part_short():
    clock, out = Clock(), io.StringIO()
    names = [f"model-{i:05d}-of-00050.safetensors" for i in range(50)]
    p = Progress([(n, 100) for n in names], out=out, tty=True, clock=clock, width=100)
    for n in names[:49]:
        p.start(n, 100)
        p.advance(n, 100)
        p.finish(n)
    p.start(names[49], 100)
    assert len(p.lines()) == 2   # one file in progress, and overall


def test_without_a_terminal_one_line_per_finished_file():
    out = io.StringIO()
    p = Progress([("a.json", 10), ("b.json", 20)], out=out, tty=False)
    p.start("a.json", 10)
    p.advance("a.json", 10)
    p.finish("a.json")
    p.finish("b.json", cached=True)
    assert out.getvalue() == "a.json: 10 B\nb.json: cached\n"


@pytest.mark.parametrize("tty", [True, False])
def test_json_lines_win_over_the_terminal_and_are_throttled(tty):
    clock, out = Clock(), io.StringIO()
    p = Progress([("a.json", 1000)], out=out, tty=tty, json_lines=True, clock=clock)
    p.begin("org/m")
    p.start("a.json", 1000)
    for _ in range(100):          # 100 updates over 1 s: about 5 lines, not 100
        clock.t += 0.01
        p.advance("a.json", 10)
    p.finish("a.json")
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in events][0] == "start" and events[-1]["event"] == "done"
    file_events = [e for e in events if e["event"] == "file"]
    assert 4 <= len(file_events) <= 7
    assert events[-1] == {"event": "done", "file": "a.json", "bytes": 1000, "cached": False}
