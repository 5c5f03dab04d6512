"""mlxd against raw mlx-lm (and, with --mlx-lm-server, against mlx_lm.server) on a GPU
(CUDA, or Metal the same way), in one run.

    python -m bench.gpu [--shapes 0.5b,7b] [--rounds 12] [--tokens 128] [--mlx-lm-server]

Random-weight bf16 models of the Qwen2.5-0.5B and 7B shapes are built on the spot (the
byte-level alphabet and one word per remaining id, so any text tokenizes and any sampled id
decodes). Every measure runs both sides back to back in each round, the order alternating
(bench/report.py); a first round, not counted, compiles every kernel shape on both sides.
Each row gives the sides' medians and the paired ratio (ours / ref, the geometric mean of the
per-round ratios) with its bootstrap 95% interval; the GPU's clocks are logged after every
round (stderr):
- single-stream decode tokens/s and TTFT (a 32-token prompt);
- aggregate decode tokens/s of 8 and 32 concurrent streams, raw: `batch_generate`;
- a 2000-token prefill (TTFT), the prompt unseen each round, as token ids;
- a warm prefix: TTFT of the same 2000 tokens plus 16 new ones, raw: from a copy of the
  prompt cache of the 2000 (what mlx-lm gives a caller that keeps its cache);
- a cold 2000-token chat message through /v1/chat/completions (template, tokenizer, the
  worker's preparation) against raw mlx-lm's `apply_chat_template` (it tokenizes too) and
  prefill of those ids;
- with --mlx-lm-server, both servers on the chat path: a cold 2000-token message, the same
  conversation a turn later (warm), one stream's decode, 8 and 32 streams.
Token-id prompts go through `/v1/completions`, so both sides run exactly the same tokens.
Goals (issue 36): single-stream >= 0.97 x raw, 8 and 32 streams >= 0.9 x raw
batch_generate, prefill (ids and chat) >= 0.95 x raw, warm prefix TTFT <= 1.5 x raw's
cached-prefix TTFT; against mlx_lm.server, ahead on every row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import http.client
import json
import math
import statistics
import sys
import time
from pathlib import Path

from bench.report import gpu_clocks, in_turn, paired_ratio, print_table, ratio_verdict
from bench.serverproc import ServerProcess
from bench.throughput import RESENT, MlxLmServer, stream_chat
from supervisor.workers import blas

MODELS_DIR = Path(__file__).resolve().parent / "models"
TOKENIZER_MARK = "bench-tokenizer-3"  # a model built before it is rebuilt
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=4096,
                 tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                 tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
               tie_word_embeddings=False),
}


def ascii_byte_chars() -> list[str]:
    """The byte-level (GPT-2) characters of the bytes 0-127, as Qwen2's tokenizer writes
    them (the space is 'Ġ')."""
    printable = [b for b in range(33, 127)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        elif not (0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF):
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(128)]


def build(shape: str, dtype: str) -> Path:
    """A qwen2 model of `shape` with random weights in `dtype`, reused if built."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = MODELS_DIR / f"gpu-{shape}-{dtype}"
    if (path / "config.json").exists() and (path / TOKENIZER_MARK).exists():
        return path
    arch = SHAPES[shape]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # The byte-level alphabet's ASCII half, then one word per remaining id: transformers 5
    # loads this tokenizer as Qwen2's own BPE class (for the qwen2 model type) and splits
    # text into bytes, older versions as the word-level model saved here. Either way any
    # ASCII text tokenizes (without the alphabet Qwen2's class dropped every word: a
    # 2000-word chat message became 3 tokens) and any id decodes to valid UTF-8 (a lone
    # byte over 127 would not, and a streaming detokenizer holds such text back forever).
    alphabet = ascii_byte_chars()
    vocab = {w: i for i, w in enumerate(specials + alphabet)}
    vocab.update({f"w{i}": i for i in range(len(vocab), arch["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # A byte-level decoder, as Qwen2.5's own tokenizer has: mlx-lm then streams text with
    # its incremental BPE detokenizer. Without one it falls back to the naive detokenizer,
    # which decodes a stream's whole text again at every token (quadratic in its length:
    # at 32 streams of 256 tokens, milliseconds of every step), a cost no real Qwen2.5
    # pays and raw batch_generate (which decodes at the end) never has.
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=specials)
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['content'] }} <|im_end|> "
                          "{% endfor %}<|im_start|>")
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **arch,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "torch_dtype": dtype, "eos_token_id": 2}
    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    fast.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / TOKENIZER_MARK).write_text("byte-level alphabet, then words\n")
    return path


# ---- raw mlx-lm, in-process ------------------------------------------------------------

def default_dtype(requested: str | None) -> str:
    """The dtype asked for, else bf16 on a GPU (how such models run there) and float32
    elsewhere (MLX's CPU backend runs it far faster than half precision)."""
    import mlx.core as mx

    return requested or ("bfloat16" if mx.default_device() == mx.gpu else "float32")


@contextlib.contextmanager
def as_shipped():
    """mlx-lm's caches and attention as they ship, for a raw call in a process that also
    imported mlxd's worker code (bench/inprocess.py): on CUDA worker/loop/batch.py installs
    worker/loop/cuda_attention.py class- and module-wide (the caches' growth, a wrapper of
    MLX's attention); both are put back for the call. (mlx-lm's batch machinery keeps
    mlxd's patches: worker/loop/mlx_lm_patches.py.)"""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    ours = sys.modules.get("worker.loop.cuda_attention")
    fused = getattr(ours, "_FUSED", None)
    steps = {cls: cls.__dict__["step"] for cls in (KVCache, BatchKVCache)}
    attention = mx.fast.scaled_dot_product_attention
    try:
        for cls in steps:
            cls.step = 256
        if fused is not None:
            mx.fast.scaled_dot_product_attention = fused
        yield
    finally:
        for cls, step in steps.items():
            cls.step = step
        mx.fast.scaled_dot_product_attention = attention


class Raw:
    def __init__(self, path: Path):
        from mlx_lm import load

        self.model, self.tokenizer = load(str(path))

    def stream(self, ids: list[int], tokens: int, cache=None) -> tuple[float, float]:
        """(TTFT s, decode tokens/s) of greedy stream_generate."""
        import mlx.core as mx
        from mlx_lm import stream_generate

        t0 = time.perf_counter()
        first = last = None
        n = 0
        with as_shipped():
            for r in stream_generate(self.model, self.tokenizer, mx.array(ids),
                                     max_tokens=tokens, prompt_cache=cache):
                now = time.perf_counter()
                first = first or now
                last, n = now, r.generation_tokens
        return first - t0, (n - 1) / (last - first) if n > 1 else float("nan")

    def chat(self, messages: list[dict], tokens: int) -> float:
        """TTFT s of a chat request as mlx-lm serves one: its `apply_chat_template`
        (rendering and tokenizing, as mlxd's worker does for every chat request), then
        greedy stream_generate."""
        t0 = time.perf_counter()
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return time.perf_counter() - t0 + self.stream(ids, tokens)[0]

    def batch(self, prompts: list[list[int]], tokens: int) -> float:
        from mlx_lm.generate import batch_generate

        t0 = time.perf_counter()
        r = batch_generate(self.model, self.tokenizer, prompts, max_tokens=tokens,
                           return_token_ids=True)
        return sum(len(t) for t in r.token_ids) / (time.perf_counter() - t0)

    def warm_prefix(self, prefix: list[int], suffix: list[int]) -> float:
        """TTFT of prefix + suffix from a copy of the prefix's prompt cache."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        with as_shipped():
            cache = make_prompt_cache(self.model)
            self.model(mx.array(prefix)[None], cache=cache)
            mx.eval([c.state for c in cache])
        return self.stream(suffix, 2, cache=copy.deepcopy(cache))[0]


# ---- mlxd over HTTP --------------------------------------------------------------------

def server_stream(port: int, model: str, ids: list[int], tokens: int,
                  key: str | None = None) -> tuple[float, float, int]:
    """(TTFT s, decode tokens/s, tokens) of a streamed /v1/completions on token ids."""
    body = {"model": model, "prompt": ids, "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if key is not None:
        body["prompt_cache_key"] = key
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = last = None
    n = 0
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        obj = json.loads(line[6:])
        if obj.get("usage"):
            n = obj["usage"]["completion_tokens"]
        if obj.get("choices") and obj["choices"][0].get("text"):
            now = time.perf_counter()
            first = first or now
            last = now
    conn.close()
    rate = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return first - t0, rate, n


def server_many(port: int, model: str, prompts: list[list[int]], tokens: int,
                apart: float = 0.0) -> float:
    """Aggregate tokens/s of a stream per prompt, sent at once or `apart` seconds apart."""
    def one(i):
        time.sleep(i * apart)
        return server_stream(port, model, prompts[i], tokens)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        t0 = time.perf_counter()
        done = list(pool.map(one, range(len(prompts))))
        return sum(d[2] for d in done) / (time.perf_counter() - t0)


# ---- one shape ---------------------------------------------------------------------------

def chat_text(tokenizer, rng, vocab: int, tokens: int) -> tuple[str, list[int]]:
    """A user message of words from the vocabulary whose templated prompt is `tokens`
    tokens or just under (however the installed transformers splits it), and those ids."""
    words = [f"w{rng.randrange(300, vocab)}" for _ in range(tokens)]

    def ids(n):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": " ".join(words[:n])}], add_generation_prompt=True))

    n = tokens
    for _ in range(8):
        got = len(ids(n))
        if got <= tokens and got >= tokens * 0.98:
            break
        n = max(1, int(n * tokens / got) - (got > tokens))
    if not tokens * 0.9 <= len(ids(n)) <= tokens:
        raise SystemExit(f"the tokenizer makes {len(ids(n))} tokens of {n} words: cannot "
                         f"build a {tokens}-token chat message")
    return " ".join(words[:n]), ids(n)


def chat_rate(port: int, model: str, messages: list[dict], tokens: int,
              retries: int = 0) -> tuple[float, float]:
    """(TTFT s, decode tokens/s) of a streamed chat completion (`retries`: a peer's,
    bench/throughput.py `request`)."""
    r = stream_chat(port, {"model": model, "messages": messages, "max_tokens": tokens,
                           "temperature": 0}, retries)
    t = r["times"]
    return r["ttft"], (r["tokens"] - 1) / (t[-1] - t[0]) if len(t) > 1 else float("nan")


def chat_many(port: int, model: str, texts: list[str], tokens: int,
              retries: int = 0) -> float:
    """Aggregate decode tokens/s of one chat stream per text, all at once."""
    def one(text):
        return stream_chat(port, {"model": model, "max_tokens": tokens, "temperature": 0,
                                  "messages": [{"role": "user", "content": text}]},
                           retries)["tokens"]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        t0 = time.perf_counter()
        made = sum(pool.map(one, texts))
        return made / (time.perf_counter() - t0)


def run_shape(shape: str, dtype: str, rounds: int, tokens: int, streams: list[int],
              kv_budget: str, lm_server: bool, m: dict | None = None) -> list:
    """The shape's rows; `m` (row → (ref's rounds, ours)) is filled with every round."""
    import random

    path = build(shape, dtype)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(0)

    def prompt(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    raw = Raw(path)
    most = max(streams)
    model = str(path)
    m = {} if m is None else m  # row → (ref's rounds, ours)
    failed: dict[str, str] = {}  # a peer's row → why the peer failed it

    def rec(key: str, i: int, ref, ours, peer: bool = False) -> None:
        """Round i of row `key`. `peer`: ref is another server, whose failure ends its row
        (printed as failed with the reason) and not the run; mlxd's failures always end
        the run."""
        if key in failed:
            return
        try:
            got = in_turn(i, {"ref": lambda _: Peer.call(ref) if peer else ref(),
                              "ours": lambda _: ours()})
        except PeerFailed as e:
            failed[key] = f"round {i}: {e}"
            print(f"  {shape} {key}: the peer failed (round {i}): {e}", file=sys.stderr,
                  flush=True)
            return
        if i > 0:  # round 0 compiles every shape on both sides: dropped
            r, o = m.setdefault(key, ([], []))
            r.append(got["ref"])
            o.append(got["ours"])

    with ServerProcess([str(path)], "--kv-budget", kv_budget, "--max-batch-size", str(most),
                       "--prefill-batch-size", "8") as srv, \
            (MlxLmServer(path) if lm_server else contextlib.nullcontext()) as lm:
        srv.wait_healthy(timeout=900)
        for i in range(rounds + 1):
            short = prompt(32)
            rec("decode", i, lambda: raw.stream(short, tokens),  # (TTFT, tokens/s)
                lambda: server_stream(srv.port, model, short, tokens)[:2])
            for n in streams:
                ps = [prompt(32) for _ in range(n)]
                rec(f"b{n}", i, lambda: raw.batch(ps, tokens),
                    lambda: server_many(srv.port, model, ps, tokens))
            long = prompt(2000)
            salt = prompt(1)  # mlxd's copy differs in its first token: unseen, cold
            rec("prefill", i, lambda: 2000 / raw.stream(long, 2)[0],
                lambda: 2000 / server_stream(srv.port, model, salt + long[1:], 2)[0])
            suffix = prompt(16)
            rec("warm", i, lambda: raw.warm_prefix(long, suffix),
                lambda: server_stream(srv.port, model, salt + long[1:] + suffix, 2)[0])
            text, ids = chat_text(raw.tokenizer, rng, vocab, 2000)
            msgs = [{"role": "user", "content": text}]
            rec("chat prefill", i, lambda: len(ids) / raw.chat(msgs, 2),
                lambda: len(ids) / chat_rate(srv.port, model, msgs, 2)[0])
            if lm is not None:
                server_rounds(i, rec, srv.port, lm.port, model, raw.tokenizer, rng, vocab,
                              tokens, streams)
            clocks = gpu_clocks()
            print(f"  {shape} round {i} done{f' [{clocks}]' if clocks else ''}",
                  file=sys.stderr, flush=True)
    rows = summarize(shape, m, streams, lm_server, failed)
    if lm is not None:  # the peer's resets, each request sent again (bench/throughput.py)
        rows.append((f"{shape} mlx_lm.server resets",
                     f"{RESENT[lm.port]} requests sent again", ""))
    return rows


class PeerFailed(Exception):
    """A peer server's request failed: its row is printed as failed, the run goes on."""


class Peer:
    RETRIES = 5  # sends of a request the peer reset unanswered (bench/throughput.py request)

    @staticmethod
    def call(fn):
        try:
            return fn()
        except Exception as e:
            raise PeerFailed(f"mlx_lm.server: {type(e).__name__}: {e}"[:300]) from e


def server_rounds(i, rec, port: int, lm_port: int, model: str, tokenizer, rng, vocab: int,
                  tokens: int, streams: list[int]) -> None:
    """One round of mlxd against mlx_lm.server, both on the chat path: a cold 2000-token
    message, the same conversation one turn later (warm), one stream's decode, and n
    streams at once ("ref" is mlx_lm.server)."""
    text, _ = chat_text(tokenizer, rng, vocab, 2000)
    first = [{"role": "user", "content": text}]
    later = first + [{"role": "assistant", "content": "w300 w301"},
                     {"role": "user", "content": f"w{rng.randrange(300, vocab)}"}]
    again = Peer.RETRIES
    for key, msgs in (("lm cold", first), ("lm warm", later)):
        rec(key, i, lambda: chat_rate(lm_port, model, msgs, 2, again)[0],
            lambda: chat_rate(port, model, msgs, 2)[0], peer=True)
    short = [{"role": "user", "content": f"w{rng.randrange(300, vocab)} w{rng.randrange(300, vocab)}"}]
    rec("lm decode", i, lambda: chat_rate(lm_port, model, short, tokens, again)[1],
        lambda: chat_rate(port, model, short, tokens)[1], peer=True)
    for n in streams:
        texts = [f"w{rng.randrange(300, vocab)} w{rng.randrange(300, vocab)}" for _ in range(n)]
        rec(f"lm b{n}", i, lambda: chat_many(lm_port, model, texts, tokens, again),
            lambda: chat_many(port, model, texts, tokens), peer=True)


def summarize(shape: str, m: dict, streams: list[int], lm_server: bool,
              failed: dict | None = None) -> list:
    """Rows: each side's median and the paired ratio (ours / ref) with its 95% interval;
    a row whose peer failed says so, with the reason."""
    rows = []

    def row(name, key, unit, op, target, ref="raw", ours="mlxd", at=None):
        if key in (failed or {}):
            rows.append((f"{shape} {name}", f"{ref} failed", f"FAILED {failed[key]}"))
            return
        r, o = m[key]
        if at is not None:  # one figure of a round's several
            r, o = [x[at] for x in r], [x[at] for x in o]
        def med(xs):
            xs = [x for x in xs if math.isfinite(x)]
            return statistics.median(xs) if xs else float("nan")
        rows.append((f"{shape} {name}", f"{ref} {med(r):.4g} {unit}, {ours} {med(o):.4g}",
                     ratio_verdict(paired_ratio(r, o), op, target)))

    row("single-stream decode", "decode", "tok/s", ">=", 0.97, at=1)
    row("single-stream TTFT", "decode", "s", "<=", 1.5, at=0)
    for n in streams:
        row(f"{n} streams", f"b{n}", "tok/s", ">=", 0.9)
    row("2000-token prefill (ids)", "prefill", "tok/s", ">=", 0.95)
    row("warm-prefix TTFT", "warm", "s", "<=", 1.5)
    row("2000-token chat prefill, cold", "chat prefill", "tok/s", ">=", 0.95)
    if lm_server:
        row("chat cold 2K TTFT", "lm cold", "s", "<=", 1.0, ref="mlx_lm.server")
        row("chat warm 2K TTFT", "lm warm", "s", "<=", 1.0, ref="mlx_lm.server")
        row("chat decode", "lm decode", "tok/s", ">=", 1.0, ref="mlx_lm.server")
        for n in streams:
            row(f"chat {n} streams", f"lm b{n}", "tok/s", ">=", 1.0, ref="mlx_lm.server")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.5b,7b")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", default="8,32")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on a GPU) or float32")
    p.add_argument("--kv-budget", default=None, help="mlxd's --kv-budget (default: 24G on a "
                   "GPU, 2G elsewhere)")
    p.add_argument("--mlx-lm-server", action="store_true",
                   help="also mlxd against mlx_lm.server, both on the chat path")
    p.add_argument("--rounds-out", default=None, metavar="PATH",
                   help="also write every round's figures, per shape, row and side, as JSON")
    args = p.parse_args()

    import mlx.core as mx

    gpu = mx.default_device() == mx.gpu
    dtype = default_dtype(args.dtype)
    info = mx.device_info()
    streams = [int(s) for s in args.streams.split(",")]
    rows, rounds = [], {}
    for shape in args.shapes.split(","):
        rows += run_shape(shape, dtype, args.rounds, args.tokens, streams,
                          args.kv_budget or ("24G" if gpu else "2G"), args.mlx_lm_server,
                          rounds.setdefault(shape, {}))
    if args.rounds_out:  # a row's spread, and which rounds made it, are not in the table
        Path(args.rounds_out).write_text(json.dumps(
            {shape: {key: {"ref": r, "ours": o} for key, (r, o) in m.items()}
             for shape, m in rounds.items()}, indent=1))
    print_table(f"mlxd vs raw mlx-lm: {info.get('device_name', info)} "
                f"(MLX {mx.__version__}, {dtype}, {args.rounds} paired rounds, {args.tokens} "
                "tokens; ratio: ours / ref, geometric mean of the rounds, [95% interval])",
                rows)


if __name__ == "__main__":
    blas.reexec()  # the raw engine here multiplies with the BLAS the workers use
    main()
