"""An agent's turns: TTFT with KV snapshots vs prefix matching only vs no prompt cache,
and resuming a long conversation after the worker restarted (the disk tier).

    python -m bench.agent_turns [--preset smollm2|small|small-hybrid|...] [--turns 10]

One conversation, the same in every mode, at temperature 0 through chat completions: a
~600-token system prompt, then per turn a tool result (~330 tokens of file text, as an
agent's read_file returns it) and the model's reply (at most 16 tokens). The default
model is the trained SmolLM2-135M: its replies are text that the chat template renders
back into the next prompt as the tokens it generated, as a real agent's are. A
random-weights preset (`small`) replies with random tokens that need not tokenize back
the same way (and whose first token's leading space the detokenizer drops): there the
snapshot falls back every turn, which the table shows as prefix-matching figures. Each
mode runs on its own fresh server:
- no cache: --prompt-cache-bytes 0;
- prefix matching: the requests carry no prompt_cache_key (no named snapshot): the
  worker matches the re-rendered prompt against its prefix cache;
- snapshots: each request carries the conversation's prompt_cache_key, so it resumes
  from the state the previous turn ended with (worker/kvcache/).
Then, on the snapshot server, two copies of the conversation (two keys) reach the last
turn; a short next turn of the first resumes from memory; the worker is killed; the same
turn of the second resumes from the disk tier; and the same turn on a server with no cache
prefills it all (cold). Goals (issue "Resume from the exact KV
state"): disk-tier TTFT <= 2 x memory-tier TTFT, and <= 0.1 x the cold prefill of the
same ~4000-token history.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from bench.make_model import model_path
from bench.report import goal, print_table
from bench.serverproc import REPO, ServerProcess
from bench.throughput import stream_chat

def word_tokens(model: Path, limit: int = 300) -> list[str]:
    """Words that are one token each with their leading space (and encode back to it):
    the texts' words, so their token counts are what they look like in any vocabulary."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    out = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i])
        if (len(text) > 2 and text[0] == " " and text[1:].isalpha() and text[1:].isascii()
                and tok.encode(text, add_special_tokens=False).ids == [i]):
            out.append(text[1:])
            if len(out) == limit:
                break
    return out


def text(words: list[str], start: int, n: int) -> str:
    return " ".join(words[(start + i * 7) % len(words)] for i in range(n))


class Conversation:
    def __init__(self, model: str, words: list[str], system_words: int = 600):
        self.model, self.words = model, words
        self.messages = [{"role": "system", "content": text(words, 0, system_words)}]

    def turn(self, srv: ServerProcess, n: int, key: str | None, words: int = 330) -> dict:
        """Send turn `n` (a tool result of `words` words) and keep the reply; returns
        stream_chat's dict."""
        # A tool's output, as an agent's read_file returns it.
        self.messages.append({"role": "user", "content": text(self.words, 1 + n, words)})
        body = {"model": self.model, "messages": self.messages, "max_tokens": 16,
                "temperature": 0}
        if key is not None:
            body["prompt_cache_key"] = key
        r = stream_chat(srv.port, body)
        self.messages.append({"role": "assistant", "content": r["text"]})
        return r

    def copy(self) -> "Conversation":
        other = Conversation(self.model, self.words)
        other.messages = [dict(m) for m in self.messages]
        return other


def cached(r: dict) -> int:
    return (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def run_mode(model: str, words: list, turns: int, mode: str) -> list[dict]:
    args = ["--prompt-cache-bytes", "0"] if mode == "no cache" else ["--prompt-cache-bytes", "2G"]
    conv = Conversation(model, words)
    with ServerProcess([model], *args, "--kv-budget", "2G") as srv:
        srv.wait_healthy(timeout=300)
        return [conv.turn(srv, n, "agent" if mode == "snapshots" else None)
                for n in range(turns)]


def worker_pid(srv: ServerProcess) -> int:
    return srv.worker_pids()[0]


NEXT_WORDS = 24  # the turn after the history: a short one, so resuming is what is timed


def restart_resume(model: str, words: list, turns: int) -> dict:
    """TTFT of a short turn after `turns`, resumed from memory and (after a kill) from disk,
    and with no cache at all."""
    first = Conversation(model, words)
    with ServerProcess([model], "--prompt-cache-bytes", "2G", "--kv-budget", "2G") as srv:
        srv.wait_healthy(timeout=300)
        for n in range(turns):
            first.turn(srv, n, "a")
        second = first.copy()
        # The same history under a second key: its own snapshot of the same state.
        second.messages = second.messages[:-2]
        second.turn(srv, turns - 1, "b")
        ram = first.copy().turn(srv, turns, "a", NEXT_WORDS)
        time.sleep(1)  # the snapshot writes reach the disk (they take milliseconds)
        pid = worker_pid(srv)
        subprocess.run([sys.executable, "-m", "mlxctl.client", "--url", srv.url,
                        "--state-dir", str(srv.state_dir), "kill"], cwd=REPO, check=True,
                       capture_output=True)
        deadline = time.monotonic() + 120
        while not (srv.worker_pids() and worker_pid(srv) != pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        srv.wait_healthy(timeout=120)
        disk = second.copy().turn(srv, turns, "b", NEXT_WORDS)
    with ServerProcess([model], "--prompt-cache-bytes", "0", "--kv-budget", "2G") as srv:
        srv.wait_healthy(timeout=300)
        cold = second.copy().turn(srv, turns, None, NEXT_WORDS)
    return {"ram": ram, "disk": disk, "cold": cold}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.agent_turns", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--model", default=None, help="a local model directory instead")
    p.add_argument("--turns", type=int, default=10)
    args = p.parse_args()
    path = model_path(args.preset, args.model)
    model, words = str(path), word_tokens(path)
    modes = ("no cache", "prefix matching", "snapshots")
    runs = {mode: run_mode(model, words, args.turns, mode) for mode in modes}
    rows = []
    for n in range(args.turns):
        prompt = runs["no cache"][n]["usage"].get("prompt_tokens", 0)
        cells = ", ".join(f"{m} {runs[m][n]['ttft'] * 1e3:.0f} ms ({cached(runs[m][n])} cached)"
                          for m in modes)
        rows.append((f"turn {n + 1} ({prompt} prompt tokens)", cells, ""))
    same = all(runs[m][n]["text"] == runs["no cache"][n]["text"]
               for m in modes for n in range(args.turns))
    rows.append(("replies identical in every mode", str(same), ""))
    r = restart_resume(model, words, args.turns)
    prompt = r["cold"]["usage"].get("prompt_tokens", 0)
    where = f"after a worker restart, a {prompt}-token prompt ({NEXT_WORDS}-word turn)"
    disk_ram = r["disk"]["ttft"] / r["ram"]["ttft"]
    disk_cold = r["disk"]["ttft"] / r["cold"]["ttft"]
    rows.append((f"{where}: disk / memory TTFT",
                 f"{r['disk']['ttft'] * 1e3:.0f} / {r['ram']['ttft'] * 1e3:.0f} ms = "
                 f"{disk_ram:.2f} ({cached(r['disk'])} / {cached(r['ram'])} cached)",
                 goal(disk_ram, "<=", 2)))
    rows.append((f"{where}: disk / cold TTFT",
                 f"{r['disk']['ttft'] * 1e3:.0f} / {r['cold']['ttft'] * 1e3:.0f} ms = "
                 f"{disk_cold:.3f}", goal(disk_cold, "<=", 0.1)))
    print_table(f"python -m bench.agent_turns --preset {args.preset} --turns {args.turns}",
                rows)


if __name__ == "__main__":
    main()
