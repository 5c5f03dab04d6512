"""`mlxctl run MODEL [PROMPT]`: chat with a model in the terminal, as `ollama run` does.

With a prompt (arguments, or stdin when it is not a terminal: both, stdin after the
arguments) it prints one streamed answer and exits: nothing but the answer goes to
stdout, for scripts. Otherwise it is a conversation at a `>>> ` prompt, with readline's
line editing and history where Python has it:
- `\"\"\"` opens a multi-line message and a line ending with `\"\"\"` closes it; a line
  ending with `\\` goes on on the next line;
- `/system TEXT` sets the system prompt (`/system` alone shows it), `/clear` forgets the
  conversation (not the system prompt), `/help`, `/bye` (or Ctrl-D) leaves;
- Ctrl-C while a reply streams stops that reply (the connection closes; the server
  cancels the generation), and the session goes on; Ctrl-C at the prompt only clears
  the line.
Each request is the whole conversation again: the server's prompt cache makes the
repeated prefix cheap. `--verbose` prints each reply's token counts and speed.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from mlxctl.connection import (EXIT_INTERRUPTED, EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE,
                               Failed, Refused)
from mlxctl.sse import EventStream

HELP = """commands:
  /system [TEXT]   set the system prompt (alone: show it)
  /clear           forget the conversation (the system prompt stays)
  /bye             leave (or Ctrl-D)
  /help            this
\"\"\" opens and closes a multi-line message; a line ending with \\ goes on.
Ctrl-C stops a reply; the conversation goes on."""
DIM, RESET = "\x1b[2m", "\x1b[0m"


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self, user: str) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns + [{"role": "user", "content": user}]

    def add(self, user: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user},
                       {"role": "assistant", "content": reply}]

    def clear(self) -> None:
        self.turns = []


def read_message(read_line: Callable[[str], str], prompt: str = ">>> ",
                 more: str = "... ") -> str | None:
    """One message from the user; None at end of input. `\"\"\"` starts a block that runs
    to a line ending with `\"\"\"`; a line ending with a backslash is continued."""
    try:
        line = read_line(prompt)
    except EOFError:
        return None
    if line.lstrip().startswith('"""'):
        first = line.lstrip()[3:]
        if first.rstrip().endswith('"""') and len(first.rstrip()) >= 3:
            return first.rstrip()[:-3]
        parts = [first] if first else []
        while True:
            try:
                line = read_line(more)
            except EOFError:
                return "\n".join(parts)
            if line.rstrip().endswith('"""'):
                tail = line.rstrip()[:-3]
                if tail:
                    parts.append(tail)
                return "\n".join(parts)
            parts.append(line)
    parts = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        try:
            line = read_line(more)
        except EOFError:
            line = ""
            break
    parts.append(line)
    return "\n".join(parts)


@dataclass
class Reply:
    text: str = ""
    usage: dict | None = None
    finish: str | None = None
    ttft: float | None = None
    seconds: float = 0.0
    stopped: bool = False        # Ctrl-C ended it
    shown: bool = False          # something (answer or reasoning) went to the screen
    error: Failed | None = None  # the server refused it, or failed it mid-reply


def describe(e: Failed) -> str:
    """A server's error as mlxctl's one line on stderr."""
    hint = "; pass --api-key or set MLXD_API_KEY" if e.status == 401 else ""
    return f"mlxctl: {e} (HTTP {e.status}{hint})"


class Chat:
    """One model's conversation over /v1/chat/completions."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None,
                 options: dict, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
                 show_reasoning: bool = True, timeout: float = 600.0):
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.options, self.out, self.err = options, out, err
        self.show_reasoning, self.timeout = show_reasoning, timeout

    def ask(self, messages: list[dict]) -> Reply:
        """Stream one reply to `out`. Ctrl-C stops it (the reply so far, `stopped`), also
        while the server has not begun it (queued, or loading the model); an error
        envelope, before or during the reply, is `error`. A lost server raises ServerDown."""
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **self.options}
        reply, t0 = Reply(), time.monotonic()
        stream = EventStream(self.base_url, "/v1/chat/completions", body,
                             api_key=self.api_key, timeout=self.timeout)
        thinking = False
        try:
            for event in stream:
                reply.usage = event.get("usage") or reply.usage
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if reply.ttft is None and (delta.get("content") or
                                               delta.get("reasoning_content")):
                        reply.ttft = time.monotonic() - t0
                    # Reasoning shows dimmed in a conversation (it is the model at work)
                    # and not at all in a one-shot answer, whose stdout is the answer.
                    if delta.get("reasoning_content") and self.show_reasoning:
                        reply.shown = True
                        if not thinking:
                            self.out.write(DIM)
                            thinking = True
                        self.out.write(delta["reasoning_content"])
                    if delta.get("content"):
                        if thinking:
                            self.out.write(RESET + "\n")
                            thinking = False
                        self.out.write(delta["content"])
                        reply.text += delta["content"]
                        reply.shown = True
                    reply.finish = choice.get("finish_reason") or reply.finish
                    self.out.flush()
        except KeyboardInterrupt:
            reply.stopped = True
        except Failed as e:
            reply.error = e
        finally:
            stream.close()   # also what tells the server to stop generating
            if thinking:
                self.out.write(RESET)
            reply.seconds = time.monotonic() - t0
        return reply

    def stats(self, reply: Reply) -> str:
        u = reply.usage or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        n = u.get("completion_tokens")
        decode = reply.seconds - (reply.ttft or 0)
        rate = f"{(n - 1) / decode:.1f} tok/s" if n and n > 1 and decode > 0 else "- tok/s"
        ttft = f"{reply.ttft * 1000:.0f} ms" if reply.ttft is not None else "-"
        return (f"prompt {u.get('prompt_tokens', '?')} tokens ({cached} cached), "
                f"reply {n if n is not None else '?'} tokens, TTFT {ttft}, {rate}")


def ensure_loaded(client, model: str, err: TextIO) -> None:
    """Load the model through the admin API if it is not loaded (a server that refuses
    the admin call may still load it on request: the chat request will tell)."""
    try:
        listing = client.call("GET", "/admin/status", timeout=10)
    except (Refused, Failed):   # no admin token, or no admin API: the request will tell
        return
    if any(w.get("model") == model and w.get("state") != "stopped"
           for w in listing.get("workers", [])):
        return
    err.write(f"loading {model}…\n")
    err.flush()
    client.call("POST", "/admin/load", {"model": model})


def one_shot(chat: Chat, conv: Conversation, prompt: str, verbose: bool) -> int:
    reply = chat.ask(conv.messages(prompt))
    if reply.shown or not reply.error:
        chat.out.write("\n")
    chat.out.flush()
    if reply.error:
        chat.err.write(describe(reply.error) + "\n")
        return EXIT_UNHEALTHY
    if verbose:
        chat.err.write(chat.stats(reply) + "\n")
    return EXIT_INTERRUPTED if reply.stopped else EXIT_OK


def command(conv: Conversation, text: str, out: TextIO) -> bool:
    """Run a `/command` line; True when it asks to leave."""
    word, _, rest = text.partition(" ")
    if word in ("/bye", "/exit", "/quit"):
        return True
    if word == "/clear":
        conv.clear()
        out.write("(conversation cleared)\n")
    elif word == "/system":
        if rest.strip():
            conv.system = rest.strip()
            out.write("(system prompt set)\n")
        else:
            out.write(f"{conv.system or '(no system prompt)'}\n")
    elif word in ("/help", "/?"):
        out.write(HELP + "\n")
    else:
        out.write(f"unknown command {word}: /help lists them\n")
    return False


def interactive(chat: Chat, conv: Conversation, read_line: Callable[[str], str],
                verbose: bool) -> int:
    out = chat.out
    out.write(f"chatting with {chat.model} (/help for commands, /bye to leave)\n")
    while True:
        try:
            text = read_message(read_line)
        except KeyboardInterrupt:
            out.write("\n(/bye or Ctrl-D leaves)\n")
            continue
        if text is None:
            out.write("\n")
            return EXIT_OK
        if not text.strip():
            continue
        if text.startswith("/") and "\n" not in text:
            if command(conv, text, out):
                return EXIT_OK
            continue
        reply = chat.ask(conv.messages(text))
        if reply.shown or reply.stopped:
            out.write("\n")
        if reply.stopped:
            out.write("^C (reply stopped)\n")
        out.flush()
        if reply.error:
            # The server failed this turn: it is not kept (there is nothing to refer to).
            chat.err.write(describe(reply.error) + "\n")
            continue
        # A stopped reply stays in the conversation as far as it got: the model said
        # that much, and the next turn may well refer to it (the playground does the
        # same). One stopped before its first word is dropped with its question: an
        # empty assistant turn means nothing, and some chat templates refuse one.
        if reply.text or not reply.stopped:
            conv.add(text, reply.text)
        if verbose:
            chat.err.write(chat.stats(reply) + "\n")


def _line_editing() -> None:
    """readline under input(): arrows, editing, history (libedit on macOS)."""
    try:
        import readline
    except ImportError:
        return
    readline.set_auto_history(True)


def prompt_of(words: list[str], piped: str | None) -> str:
    """The one-shot prompt: the arguments, then what stdin held (None: a terminal) after
    a blank line, so `cat notes.txt | mlxctl run M summarize` asks about the file."""
    prompt = " ".join(words)
    if piped is None or not piped.strip():
        return prompt
    return f"{prompt}\n\n{piped}" if prompt else piped


def cmd_run(args, client, deps) -> int:
    stdin = sys.stdin
    prompt = prompt_of(args.prompt, None if stdin.isatty() else stdin.read())
    if not stdin.isatty():
        if not prompt.strip():
            print("mlxctl: no prompt (give one as arguments or on stdin)", file=sys.stderr)
            return EXIT_USAGE
    options = {}
    if args.temperature is not None:
        options["temperature"] = args.temperature
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    ensure_loaded(client, args.model, sys.stderr)
    api_key = args.api_key or os.environ.get("MLXD_API_KEY")
    if prompt:
        chat = Chat(client.url, args.model, api_key=api_key, options=options,
                    show_reasoning=False, timeout=client.timeout)
        return one_shot(chat, Conversation(system=args.system), prompt, args.verbose)
    chat = Chat(client.url, args.model, api_key=api_key, options=options,
                timeout=client.timeout)
    _line_editing()
    return interactive(chat, Conversation(system=args.system), input, args.verbose)


def add_parser(add) -> None:
    sp = add("run", cmd_run, "chat with MODEL in the terminal (one answer with PROMPT)")
    sp.add_argument("model")
    sp.add_argument("prompt", nargs="*", help="ask this once and print the answer")
    sp.add_argument("--system", default=None, help="the system prompt")
    sp.add_argument("--temperature", type=float, default=None)
    sp.add_argument("--max-tokens", type=int, default=None)
    sp.add_argument("--verbose", action="store_true",
                    help="after each reply: tokens (cached), time to first token, tokens/s")
    sp.add_argument("--api-key", default=None, help="the server's API key [MLXD_API_KEY]")
